"""One rank: pipeline schedules, tensor / sequence parallelism, FSDP2, each rank predicted in one process and measured on a real process group."""
