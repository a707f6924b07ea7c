"""The KV-event replay socket under hostile or careless peers (issue 51, item 11): before, it
answered each request with every kept batch at once, and ZeroMQ queued up to 1,000 messages
for a peer that never read (40 silent requests added 964 MiB to the publisher). One answer now
holds at most REPLAY_MAX_BATCHES batches and REPLAY_MAX_BYTES bytes (the rest on asking again
from the next number), a peer's queue one answer, and all answers within REPLAY_WINDOW_S at
most REPLAY_WINDOW_BYTES, so silent peers cannot grow the publisher."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from runner.kv_events.config import KVEventsConfig
from runner.kv_events.publisher import KVEventPublisher
from runner.kv_events.replay import REPLAY_MAX_BYTES, REPLAY_WINDOW_BYTES
from runner.kv_events.schema import BlockStored

BATCHES = 100
TOKENS = 25_000  # ~75 KB a batch (3 msgpack bytes a token): ~7.5 MB kept in all


@pytest.fixture(scope="module")
def publisher() -> Iterator[KVEventPublisher]:
    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    pub = KVEventPublisher(config, block_size=TOKENS)
    try:
        for i in range(-1, BATCHES):  # one batch each: the thread flushes before the next
            if i >= 0:  # -1: the start's AllBlocksCleared, number 0
                pub.publish([BlockStored([i], None, [40_000] * TOKENS, TOKENS, None, "GPU")])
            deadline = time.monotonic() + 10
            while pub.next_seq < i + 2 and time.monotonic() < deadline:
                time.sleep(0.002)
        assert pub.next_seq == BATCHES + 1
        yield pub
    finally:
        pub.close()


def ask(endpoint: str, start: int) -> list[tuple[int, int]]:
    """One replay request as a subscriber makes it: (seq, payload bytes) of each batch."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while dealer.poll(10_000):
            _, seq_bytes, payload = dealer.recv_multipart()
            if not payload:
                return got
            got.append((int.from_bytes(seq_bytes, "big"), len(payload)))
        raise AssertionError("the replay did not end")
    finally:
        dealer.close()


def silent_peer(port: int, start: int) -> socket.socket:
    """A peer that speaks ZMTP 3.1 (NULL security) far enough to ask for a replay, then never
    reads a byte, as a hostile client would. Each step waits for the publisher's (libzmq reads
    the greeting and the handshake apart)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    greeting = b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32)
    sock.sendall(greeting[:11])  # the signature and major version: then it sends the rest
    receive(sock, 64)  # its greeting
    sock.sendall(greeting[11:])
    receive(sock, receive(sock, 2)[1])  # its READY: flags, size, body
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    request = b"\x01\x00" + b"\x00\x08" + start.to_bytes(8, "big")  # [b"", start]
    sock.sendall(bytes([0x04, len(ready)]) + ready + request)
    return sock


def receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        assert more, "the publisher closed the connection"
        data += more
    return data


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_one_answer_is_bounded_and_asking_again_gets_the_rest(publisher: KVEventPublisher) -> None:
    assert publisher.replay_endpoint is not None
    first = ask(publisher.replay_endpoint, 0)
    largest = max(size for _, size in first)
    assert 0 < sum(size for _, size in first) <= REPLAY_MAX_BYTES + largest
    assert len(first) < BATCHES + 1  # before: all 101 in one answer, ~7.5 MB
    got, rounds = list(first), 1
    while got[-1][0] < BATCHES:
        more = ask(publisher.replay_endpoint, got[-1][0] + 1)
        assert more and sum(size for _, size in more) <= REPLAY_MAX_BYTES + largest
        got += more
        rounds += 1
    assert [seq for seq, _ in got] == list(range(BATCHES + 1)) and rounds >= 2


def test_silent_peers_do_not_grow_the_publisher(publisher: KVEventPublisher) -> None:
    """40 peers ask for everything and never read: before, each answer (~7.5 MB) was queued
    whole (~300 MB here); now what all answers hold within the window is bounded."""
    assert publisher.replay_endpoint is not None
    port = int(publisher.replay_endpoint.rsplit(":", 1)[1])
    time.sleep(0.2)
    before = rss_mib()
    peers = [silent_peer(port, 0) for _ in range(40)]
    try:
        time.sleep(2.0)  # the publisher's thread has answered (or refused) each by now
        grown = rss_mib() - before
        print(f"40 silent replay requests: +{grown:.0f} MiB")
        assert grown < REPLAY_WINDOW_BYTES / 2**20, f"{grown:.0f} MiB"
        # The publisher still answers at once; within the window the silent peers' answers
        # spent its budget: a batch at most (the first of an answer goes while room is left).
        start = time.monotonic()
        assert len(ask(publisher.replay_endpoint, 0)) <= 1
        assert time.monotonic() - start < 5.0
    finally:
        for peer in peers:
            peer.close()
