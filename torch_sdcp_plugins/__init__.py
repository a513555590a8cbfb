"""Entry points that engines load in every process. Each module here imports
nothing of torch_sdcp (whose import loads the C++ extension) until its engine
integration is switched on, and never raises into the engine's start-up."""
