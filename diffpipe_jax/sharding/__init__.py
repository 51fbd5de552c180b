"""Device mesh ('data', 'stage') and sharding policies: lands with data and pipeline parallelism."""
