"""Bytes on the target device: the allocator rule, op scratch (one table, one calibration), static memory, the CUDA target modelled on a CPU."""
