"""Exceptions raised by mpitp.

Every error that depends on what *other* ranks passed is raised identically on every
rank (same class, same message), so an SPMD program fails the same way everywhere
instead of leaving some ranks blocked in a collective.
"""


class MpitpError(Exception):
    """Base class of all mpitp errors."""


class CollectiveMismatchError(MpitpError, ValueError):
    """Ranks called the same collective with incompatible arguments.

    Raised on every rank when validation is on (``Communicator(validate=True)`` or
    ``MPITP_VALIDATE=1``): dtype, shape, count, op, root or algorithm differ across
    ranks, or one rank's arguments were invalid.
    """


class UnsupportedOperation(MpitpError, ValueError):
    """The requested op/dtype/algorithm combination cannot be carried out."""
