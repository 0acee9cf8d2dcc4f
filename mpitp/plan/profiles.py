"""Link profiles for the alpha-beta model: latency (s) and bandwidth (B/s) per link class.

``T_link(X) = alpha + X / beta`` moves X bytes over one link of that class.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..comm.algorithms.tuning import default_path
from ..errors import MpitpError


class ProfileError(MpitpError, ValueError):
    """A link profile that does not exist (a typo, or 'local' before ``mpitp plan fit``)."""


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # bytes per second

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Profile:
    name: str
    intra: Link
    inter: Link
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES = {
    # the cluster of seed 000 (README, "The seeds' numbers"): NVLink/NVSwitch inside a node,
    # InfiniBand 200 Gb/s between nodes
    "nvlink-ib200": Profile(
        "nvlink-ib200",
        Link(2e-6, 600e9),
        Link(5e-6, 200e9 / 8),
        "NVLink 600 GB/s inside a node, InfiniBand HDR 200 Gb/s (25 GB/s) between nodes",
    ),
    "nvlink-ib400": Profile(
        "nvlink-ib400", Link(2e-6, 900e9), Link(4e-6, 400e9 / 8), "NVLink 900 GB/s (H100), InfiniBand NDR 400 Gb/s"
    ),
    "pcie-eth100": Profile(
        "pcie-eth100",
        Link(5e-6, 25e9),
        Link(20e-6, 100e9 / 8),
        "PCIe 4.0 x16 inside a node, 100 Gb Ethernet between nodes",
    ),
}
SEED = "nvlink-ib200"


def local_profile_path() -> Path:
    return default_path().with_name("profile-local.json")


def save_local(profile: Profile, path: Path | None = None) -> Path:
    p = path or local_profile_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    tmp.replace(p)
    return p


def get(name: str | None, alpha_intra=None, beta_intra=None, alpha_inter=None, beta_inter=None) -> Profile:
    """A named profile ('local' reads the fitted one), with user numbers overriding fields."""
    name = name or SEED
    if name == "local":
        p = local_profile_path()
        if not p.exists():
            raise ProfileError(f"no fitted profile at {p}: run 'mpiexec -n 2 mpitp plan fit' on this machine first")
        d = json.loads(p.read_text())
        prof = Profile(d["name"], Link(**d["intra"]), Link(**d["inter"]), d.get("note", ""))
    elif name in PROFILES:
        prof = PROFILES[name]
    else:
        raise ProfileError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}, local")
    intra = Link(
        alpha_intra if alpha_intra is not None else prof.intra.alpha,
        beta_intra if beta_intra is not None else prof.intra.beta,
    )
    inter = Link(
        alpha_inter if alpha_inter is not None else prof.inter.alpha,
        beta_inter if beta_inter is not None else prof.inter.beta,
    )
    custom = (intra, inter) != (prof.intra, prof.inter)
    return Profile(prof.name + (" (custom)" if custom else ""), intra, inter, prof.note)


def link_from_half_trips(half: dict[int, float]) -> Link:
    """The link ``T(X) = alpha + X / beta`` through two measured half round trips
    ``{small: t_small, large: t_large}`` (bytes -> seconds): alpha is the small message's
    time, beta the bytes added over the time added. A large message no slower than the
    small one (timer noise) gives the 1 ns floor rather than a negative bandwidth."""
    small, large = sorted(half)
    return Link(half[small], (large - small) / max(half[large] - half[small], 1e-9))


def half_trips(comm, a: int, b: int, sizes=(8, 1 << 22), reps: int = 20) -> dict[int, float]:
    """The best half round trip of each message size between ranks ``a`` and ``b`` of
    ``comm`` (a mpi4py comm; collective: every rank gets the figures)."""
    import time

    import numpy as np

    r = comm.rank
    half = {}
    for n in sizes:
        buf = np.zeros(n, np.uint8)
        best = float("inf")
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            if r == a:
                comm.Send(buf, b)
                comm.Recv(buf, b)
            elif r == b:
                comm.Recv(buf, a)
                comm.Send(buf, a)
            best = min(best, (time.perf_counter() - t0) / 2)
        half[n] = comm.bcast(best, root=a)
    return half


def fit(comm, sizes=(8, 1 << 22), reps: int = 20) -> Profile:
    """Fit alpha and beta from a ping-pong between ranks 0 and 1 of ``comm`` (a mpi4py comm).

    alpha = half round trip of a tiny message; beta from the large message's half round
    trip minus alpha. Ranks on one machine give the intra-node link; the same figures stand
    in for 'inter' when nodes are only simulated.
    """
    link = link_from_half_trips(half_trips(comm, 0, 1, sizes, reps))
    return Profile(
        "local",
        link,
        link,
        f"fitted by ping-pong on this machine (alpha {link.alpha * 1e6:.1f} us, "
        f"beta {link.beta / 1e9:.2f} GB/s); inter = intra on simulated nodes",
    )


def fit_nodes(comm, nodes: list[list[int]], sizes=(8, 1 << 22), reps: int = 20) -> Profile:
    """Fit both links on real nodes (``nodes``: the ranks of each, as
    :class:`~mpitp.comm.topology.Topology` lists them): 'intra' from a ping-pong between
    two ranks of one node, 'inter' from one between the first ranks of the first two
    nodes, so it crosses the network. With one node, or no node holding two ranks, the
    one link measured stands for both."""
    pair = next((ranks[:2] for ranks in nodes if len(ranks) >= 2), None)
    intra = link_from_half_trips(half_trips(comm, pair[0], pair[1], sizes, reps)) if pair else None
    inter = link_from_half_trips(half_trips(comm, nodes[0][0], nodes[1][0], sizes, reps)) if len(nodes) > 1 else None
    intra, inter = intra or inter, inter or intra
    assert intra is not None and inter is not None  # two ranks are needed to fit anything
    return Profile(
        "fitted",
        intra,
        inter,
        f"fitted by ping-pong: intra alpha {intra.alpha * 1e6:.1f} us, beta {intra.beta / 1e9:.2f} GB/s; "
        f"inter alpha {inter.alpha * 1e6:.1f} us, beta {inter.beta / 1e9:.3f} GB/s",
    )
