raise ImportError("libacme_kernels.so: cannot open shared object file (simulated)")
