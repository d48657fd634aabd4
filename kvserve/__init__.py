"""kvserve: a small LLM inference engine you can read and run fast."""
from kvserve.config import EngineConfig
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.llm import LLM
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "PoolingParams", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
