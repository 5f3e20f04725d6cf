"""One engine: policy and the step loop (request and step plan, scheduler, connector, runner,
step loop, sampling, the facade and `build_engine`). What another target's runner needs is exported
here, so it plugs in without reaching into the modules."""
from .facade import Engine, build_engine
from .kv_load import LoadedBlocks
from .request import RequestOutput, RowPlan, StepPlan
from .runner import StepFuture
from .sampling import SamplingParams

__all__ = ["Engine", "build_engine", "LoadedBlocks", "RequestOutput", "RowPlan", "StepPlan", "StepFuture",
           "SamplingParams"]
