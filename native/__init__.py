"""Native code the Python packages load: the driver that compiles a C++ ExecuTorch kernel into a shared library
(compiler.py). It stands below models/ and imports nothing of this repository, so models/ can load what it builds
without importing upward."""
