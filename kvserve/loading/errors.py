"""One error type for everything that goes wrong while loading a model."""


class ModelLoadError(ValueError):
    """A model path, file or config that kvserve cannot load. The message names the file."""

    def __init__(self, path: object, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
