from runner.registry import Registry

MODELS = Registry("model")
