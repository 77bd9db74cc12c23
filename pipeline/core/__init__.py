"""The step loop: sequences, the scheduler, the sampler, the model runner (and its tensor-parallel
driver and workers), the engine core and the in-process ``Engine`` that composes every stage."""
