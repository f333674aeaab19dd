"""The same-host data plane: K/V moves through shared memory (and CUDA IPC), the socket carries control."""
