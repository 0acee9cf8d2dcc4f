"""Weights as the file stores them: block formats held planar (:mod:`.formats`), repacked
into the int8 kernels' tiles (:mod:`.tiles`), widened to float32 (:mod:`.dequant`). Data
and repacking; the kernels that multiply them live one floor up, in :mod:`mpitp.kernels`."""
