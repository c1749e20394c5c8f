"""The KV tier behind the block pool: blocks as files (`file_tier`), moved in and out of the pool
one whole block at a time (`transfer`)."""
