from kvserve.loading.errors import ModelLoadError
from kvserve.loading.loader import LoadedModel, load_model
from kvserve.loading.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "Tokenizer", "load_model"]
