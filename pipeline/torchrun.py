"""`python -m pipeline.torchrun [torchrun args] -m pipeline ...`: torchrun on one machine, listening on 127.0.0.1 only.

torchrun's stores (c10d TCPStore: the rendezvous and the agent's store its ranks meet at) listen on every
interface whatever host the rendezvous names: with torch 2.13, `--standalone`, `--rdzv-endpoint 127.0.0.1:0`
and `--master-addr 127.0.0.1` all leave them bound to `::` (measured), so anyone who can reach the machine can
connect to the job's store for the whole run. TCPStore binds a listening socket it is handed instead
(`master_listen_fd`); this launcher hands every store torchrun hosts on a loopback host one bound to 127.0.0.1,
runs the rendezvous at `127.0.0.1:0` (c10d, a free port; in place of `--standalone`, which it drops) and keeps
the ranks' gloo and NCCL sockets on the loopback interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo where
unset). Everything else is torchrun's own (`torch.distributed.run.main`). Several machines need a rendezvous on
the network: run torchrun itself there (README).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
STORE_ARGS = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd",
              "use_libuv")
RENDEZVOUS_FLAGS = ("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                    "--master_addr", "--nnodes")


def loopback_store_class():
    """torch.distributed.TCPStore, except that a server on a loopback host listens on 127.0.0.1 only."""
    import torch.distributed as dist

    class LoopbackTCPStore(dist.TCPStore):
        def __init__(self, host_name: str, port: int = 0, *args, **kwargs):
            kw = {**dict(zip(STORE_ARGS, args)), **kwargs}
            if kw.get("is_master") and kw.get("master_listen_fd") is None and host_name in LOOPBACK_HOSTS:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen()
                self._listener = sock  # the store serves on it as long as the store lives
                port = sock.getsockname()[1]
                kw.update(master_listen_fd=sock.fileno(), use_libuv=True)
            super().__init__(host_name, port, **kw)

    return LoopbackTCPStore


def torchrun_args(argv: list[str]) -> list[str]:
    """`argv` with the rendezvous at 127.0.0.1:0 unless it names one itself (then it must be on one machine)."""
    args = [a for a in argv if a != "--standalone"]
    script = args.index("-m") if "-m" in args else len(args)  # what follows is the program's own
    if any(a.split("=")[0] in RENDEZVOUS_FLAGS for a in args[:script]):
        return args
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", uuid.uuid4().hex, *args]


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.TCPStore = loopback_store_class()  # before torch.distributed.run imports the rendezvous backends
    from torch.distributed.run import main as torchrun

    torchrun(torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
