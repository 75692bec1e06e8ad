"""Running the model: the runner, kvroute's decoder and transformers' modules on the paged
kernels, built-in models, sampling, CUDA graphs, LoRA weights, and the step-time cost model
with the runner that sleeps for it."""
