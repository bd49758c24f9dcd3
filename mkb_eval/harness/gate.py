"""The gate socket between parent and worker: lane gates and timing operations out, the worker's replies
in, each reply stamped by the kernel when the worker sent it (the attested window's clock,
:mod:`mkb_eval.harness.attest`)."""

from __future__ import annotations

import socket
import struct
import time

from mkb_eval.harness.protocol import Op, encode_op

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)    # the same number on x86-64 and arm64 Linux
MAX_PACKET = 1 << 20


class GateSocket:
    """The parent's end of a worker's gate: lane gates and window messages out, window replies in,
    each reply stamped by the kernel when the worker sent it."""

    def __init__(self) -> None:
        self.sock, self.child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        for s in (self.sock, self.child):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_PACKET)

    def child_fd(self) -> int:
        return self.child.fileno()

    def close_child(self) -> None:
        self.child.close()

    def send(self, data: bytes) -> int:
        """Send one packet; the realtime ns just before (the worker cannot have it earlier)."""
        t = time.clock_gettime_ns(time.CLOCK_REALTIME)
        self.sock.send(data)
        return t

    def send_op(self, op: Op) -> int:
        """Send one timing operation (encoded before the send time is taken)."""
        return self.send(encode_op(op))

    def recv(self, timeout: float) -> tuple[bytes, int]:
        """(packet, the kernel's stamp of its send in realtime ns); b"" at EOF; TimeoutError past ``timeout``."""
        self.sock.settimeout(max(timeout, 1e-3))
        try:
            data, anc, _flags, _ = self.sock.recvmsg(MAX_PACKET, socket.CMSG_SPACE(16))
        except socket.timeout:
            raise TimeoutError(f"no reply from the worker in {timeout:.0f} s") from None
        except OSError:
            return b"", time.clock_gettime_ns(time.CLOCK_REALTIME)
        stamp = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
                sec, ns = struct.unpack("qq", payload[:16])
                stamp = sec * 1_000_000_000 + ns
        if stamp is None:            # no kernel stamp (not Linux?): the read time, later than the send
            stamp = time.clock_gettime_ns(time.CLOCK_REALTIME)
        return data, stamp

    def close(self) -> None:
        for s in (self.sock, self.child):
            try:
                s.close()
            except OSError:
                pass
