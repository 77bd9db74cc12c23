"""The engine shared by every stage, in rooms whose arrows run one way:

    core -> frontend -> models -> parallel -> contract

``core`` (the step loop) composes the others; ``frontend`` turns text and images into token ids;
``models`` holds architectures, configs, loading and the model's identity; ``parallel`` what a
tensor-parallel group is; ``contract`` what crosses a process boundary.
"""
