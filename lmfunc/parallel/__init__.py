"""Distribution from placements: the device mesh, logical-axis sharding rules, and the helpers the
model calls at the few points where a layout matters (gathering FSDP shards, local attention)."""
