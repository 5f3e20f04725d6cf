"""One engine: policy and the step loop (request and step plan, scheduler, connector, runner, the
step output, sampling, `EngineCore`, the `Engine` a caller holds and its `EngineInterface`, and
`build_engine`). What another target's runner needs is exported here, so it plugs in without
reaching into the modules."""
from .assembly import build_engine
from .engine import Engine
from .interface import CacheNaming, EngineInterface, StepAPI
from .kv_load import LoadedBlocks
from .request import RequestOutput, RowPlan, StepPlan
from .runner import RunnerSaves, StepFuture
from .sampling import SamplingParams
from .step_output import SaveReport, StepOutput

__all__ = ["Engine", "EngineInterface", "StepAPI", "CacheNaming", "build_engine", "LoadedBlocks", "RequestOutput",
           "RowPlan", "StepPlan", "StepFuture", "StepOutput", "SaveReport", "RunnerSaves", "SamplingParams"]
