"""The fleet's LoRA adapters as a front door knows them (:mod:`.registry`), and the one
registry every front door of a fleet shares (:mod:`.shared`)."""
