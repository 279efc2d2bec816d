"""The internal C headers the loops share (csrc/heap.h, csrc/ring.h, csrc/ip6text.h,
csrc/clock.h), each compiled into a small harness under ASan/UBSan with -Werror.

- heap.h: random pushes, removals anywhere and re-keys against a brute-force model;
  the heap property and every element's index hold after each step, and popping
  gives the deadlines in order;
- ip6text.h: ``sw_ip6_text`` writes exactly ``str(ipaddress.IPv6Address(a))`` as
  Python 3.11 spells it (hex hextets, the first longest zero run as ``::``, never a
  dotted IPv4 tail), for edge cases and random addresses with zero runs;
- ring.h: the counters wrap at 2**32 without losing room or records, and
  ``sw_pow2_at_least`` rounds up to its cap;
- clock.h: the monotonic clock never goes back, the real one is Unix time in ms.
"""

from __future__ import annotations

import ipaddress
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"

HARNESS = r"""
#define _GNU_SOURCE
#include "clock.h"
#include "heap.h"
#include "ip6text.h"
#include "ring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #c); \
    abort(); } } while (0)

struct elem { uint64_t deadline; size_t idx; };
struct owner { struct elem **heap; size_t heap_len, heap_cap; };
SW_HEAP_DEFINE(h, struct owner, struct elem, idx, deadline)

static uint64_t seed = 88172645463325252ull;
static uint64_t rnd(void)
{
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
}

static void check_heap(struct owner *L)
{
    for (size_t i = 0; i < L->heap_len; i++) {
        CHECK(L->heap[i]->idx == i);
        if (i)
            CHECK(L->heap[(i - 1) / 2]->deadline <= L->heap[i]->deadline);
    }
}

static int heap_test(void)
{
    enum { N = 300 };
    static struct elem e[N];
    struct owner L = {0};
    for (int i = 0; i < N; i++)
        e[i].idx = SIZE_MAX;
    for (int step = 0; step < 200000; step++) {
        struct elem *x = &e[rnd() % N];
        if (x->idx == SIZE_MAX) {
            x->deadline = rnd() % 1000;
            CHECK(h_push(&L, x, 4) == 0);
        } else if (rnd() % 3) {
            size_t i = x->idx;
            x->idx = SIZE_MAX;
            h_remove(&L, i);
        } else { /* re-key in place, as a timer moved later or earlier */
            x->deadline = rnd() % 1000;
            h_up(&L, x->idx);
            h_down(&L, x->idx);
        }
        check_heap(&L);
    }
    uint64_t last = 0;
    while (L.heap_len) {
        struct elem *top = L.heap[0];
        CHECK(top->deadline >= last);
        last = top->deadline;
        top->idx = SIZE_MAX;
        h_remove(&L, 0);
        check_heap(&L);
    }
    free(L.heap);
    return 0;
}

static int ring_test(void)
{
    _Atomic uint32_t head = UINT32_MAX - 5, tail = UINT32_MAX - 5;
    const uint32_t mask = 7;
    uint32_t slots[8], taken = 0, put = 0;
    for (int round = 0; round < 100; round++) {
        while (sw_ring_has_room(&head, &tail, mask)) {
            uint32_t at = sw_ring_head(&head);
            slots[at & mask] = put++;
            sw_ring_publish(&head, at);
        }
        CHECK(sw_ring_used(&head, &tail) == mask + 1);
        uint32_t t = sw_ring_tail(&tail), end = sw_ring_ready(&head);
        for (uint32_t k = rnd() % 9; k && t != end; k--, t++)
            CHECK(slots[t & mask] == taken++);
        sw_ring_release(&tail, t);
    }
    CHECK(sw_pow2_at_least(0, 1u << 24) == 1 && sw_pow2_at_least(1, 1u << 24) == 1);
    CHECK(sw_pow2_at_least(5, 1u << 24) == 8 && sw_pow2_at_least(8, 1u << 24) == 8);
    CHECK(sw_pow2_at_least(UINT32_MAX, 1u << 24) == 1u << 24);
    CHECK(sw_pow2_at_least(UINT32_MAX, 1u << 30) == 1u << 30);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "ip6")) {
        /* stdin: one address a line, 32 hex digits; stdout: its text */
        char line[64];
        while (fgets(line, sizeof line, stdin)) {
            uint8_t a[16];
            for (int i = 0; i < 16; i++)
                CHECK(sscanf(line + 2 * i, "%2hhx", &a[i]) == 1);
            char *out = malloc(SW_IP6_TEXT_MAX + 1);
            size_t n = sw_ip6_text(a, out);
            CHECK(n <= SW_IP6_TEXT_MAX && strlen(out) == n);
            puts(out);
            free(out);
        }
        return 0;
    }
    if (argc > 1 && !strcmp(argv[1], "clock")) {
        uint64_t m0 = sw_mono_ms(), m1 = sw_mono_ms();
        CHECK(m1 >= m0);
        printf("%llu\n", (unsigned long long)sw_real_ms());
        return 0;
    }
    heap_test();
    ring_test();
    puts("ok");
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    tmp = tmp_path_factory.mktemp("headers")
    src = tmp / "harness.c"
    src.write_text(HARNESS)
    exe = tmp / "harness"
    cmd = ["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
           "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{CSRC}",
           str(src), "-o", str(exe)]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return exe


def test_heap_and_ring_hold_their_invariants(harness: Path) -> None:
    run = subprocess.run([str(harness)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def _addresses() -> list[bytes]:
    rng = random.Random(20261127)
    fixed = ["::", "::1", "1::", "2001:db8::1", "2001:db8:0:0:1:0:0:1", "1:0:0:2:0:0:0:3",
             "::ffff:192.0.2.1", "::192.0.2.1", "fe80::1:0:0:0", "0:1:0:1:0:1:0:1",
             "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "1:2:3:4:5:6:7:0", "0:0:1::"]  # fmt: skip
    out = [ipaddress.IPv6Address(a).packed for a in fixed]
    for _ in range(3000):
        hextets = [rng.choice([0, 0, 0, rng.randrange(1, 16), rng.randrange(65536)])
                   for _ in range(8)]  # fmt: skip
        out.append(b"".join(h.to_bytes(2, "big") for h in hextets))
    return out


def test_ip6_text_is_pythons(harness: Path) -> None:
    addresses = _addresses()
    run = subprocess.run(
        [str(harness), "ip6"],
        input="".join(a.hex() + "\n" for a in addresses),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # 3.11's str() (3.13 would write ::ffff:a.b.c.d for mapped ones: not ours)
    expected = [str(ipaddress.IPv6Address(a)) for a in addresses]
    if any("." in e for e in expected):
        pytest.skip("this Python writes mapped addresses as dotted quads")
    assert run.stdout.split("\n")[:-1] == expected


def test_clocks(harness: Path) -> None:
    before = int(time.time() * 1000)
    run = subprocess.run([str(harness), "clock"], capture_output=True, text=True, check=False)
    after = int(time.time() * 1000)
    assert run.returncode == 0, run.stderr
    assert before - 1 <= int(run.stdout) <= after + 1
