"""The fleet's LoRA adapters as a front door knows them (:mod:`.registry`; the adapter
record and its errors in :mod:`.adapter`, the holders-only view of the fleet in
:mod:`.holders`), and the one registry every front door of a fleet shares (:mod:`.shared`)."""
