"""The plumbing every command shares: the console and its errors, processes (platforms, host memory, the compilation
cache, stop signals, process limits), workdirs (one job each, their paths) and the files a job reads and writes
(checked inputs, outputs written whole, gs:// preconditions, TensorBoard events)."""
