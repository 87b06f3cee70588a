"""`kvtopo.ports.free_port` under pressure: a port chosen for a process that binds it later
cannot be taken first by anything that binds port 0 or connects out meanwhile (issue 58: the
operator's liveness port, chosen by bind(0), was taken before it bound under a busy CI run:
"address already in use")."""

from __future__ import annotations

import socket
import threading

from kvtopo import ports


def test_a_chosen_port_is_out_of_the_range_bind_0_draws_from_and_stays_bindable() -> None:
    low = ports._ephemeral_low()
    held: list[socket.socket] = []
    stop = threading.Event()

    def hog() -> None:
        """Binds ephemeral ports as fast as it can (each outgoing connection or bind(0) of
        a busy machine takes one), holding them."""
        while not stop.is_set() and len(held) < 3000:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)

    thread = threading.Thread(target=hog)
    thread.start()
    try:
        chosen = [ports.free_port() for _ in range(200)]
    finally:
        stop.set()
        thread.join()
    try:
        assert all(port < low for port in chosen), (low, max(chosen))
        assert len(set(chosen)) == len(chosen), "a port handed out twice"
        taken = {s.getsockname()[1] for s in held}
        assert not taken & set(chosen)
        for port in chosen[:50]:  # still free for the process that binds it later
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
