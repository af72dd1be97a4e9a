"""The upstream checkouts cpkit holds to its tests, shared by every feature: a checkout's
identity (`checkouts.py`) and Megatron-Bridge's own code loaded by file path (`bridge.py`).
Megatron-LM dev's dynamic-CP loader is the dynamic feature's (`cpkit.dynamic.mlm`)."""
