"""Planning without running: the alpha-beta cost model, TP and FSDP/ZeRO plans."""
