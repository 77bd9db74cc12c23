"""One class per stage, plain Python and no Ray: Preprocessor, VisionEncoder, Prefiller, Decoder, the
prefill/decode services that step them on a thread, and the factory that loads a process's stages.
The in-process engine composes them; ``deployments`` wraps each in a Serve deployment."""
