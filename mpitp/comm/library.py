"""The MPI library in use, as one printable line."""
from mpi4py import MPI


def library_version() -> str:
    """First line of ``MPI_Get_library_version`` (Open MPI pads it with NUL bytes)."""
    text = MPI.Get_library_version().replace("\x00", "").strip()
    return text.splitlines()[0].strip() if text else "unknown MPI"
