"""The engine inside a Ray actor: lifecycle, the data-plane server, the event publisher."""
