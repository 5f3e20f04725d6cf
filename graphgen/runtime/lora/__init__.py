"""Multi-LoRA at run time: PEFT adapters read and checked against a spec (`peft`), the device slots they are
loaded into on demand and evicted from LRU (`slots`), the batched delta the generated graphs apply (`delta`).
docs/lora.md."""

from .delta import LoraWeight, lora
from .peft import Adapter, AdapterError, read_adapter
from .slots import LoraSlots, SlotBusyError

__all__ = ["Adapter", "AdapterError", "LoraSlots", "LoraWeight", "SlotBusyError", "lora", "read_adapter"]
