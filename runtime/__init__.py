"""The streaming runtime: devices, the memory tracker, and the program executor."""
