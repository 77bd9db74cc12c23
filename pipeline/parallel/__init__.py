"""What a tensor/expert-parallel group is: who holds which slice (``shard_plan``), the group and its
collectives (``tp_group``), the single-node shared-memory channel, and named fault points. Knows no
model and no step; ``models`` shards layers with it and ``core`` drives steps over it."""
