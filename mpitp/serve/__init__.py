"""`mpitp serve`: an OpenAI-compatible server over tensor-parallel ranks."""
