#!/usr/bin/env python3
"""Where a loaded classifier spends its time, by source line.

Samples every CPU with `perf record` for a while, then, while the programs
are still loaded, maps each sample inside a BPF program to the source line
the JIT produced it from: the program's jited line info (the address of
each line's machine code, from BPF_OBJ_GET_INFO_BY_FD) gives the BPF
instruction, and `bpftool prog dump xlated linum` that instruction's file
and line. Debian's perf cannot annotate BPF programs (built without
libbfd), and bpftool cannot dump their machine code; this needs neither.

Run the workload first (a benchmark repeating one packet, say), then:

    scripts/bpf-line-profile.py --seconds 10 --program to_pod

Prints the share of all samples per kernel symbol, then per program,
function and source line. Root only. Reads only; loads nothing.
"""

import argparse
import bisect
import collections
import ctypes
import os
import re
import struct
import subprocess
import sys
import tempfile

SYS_BPF = 321  # x86-64
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
INFO_SIZE = 256

# Offsets in struct bpf_prog_info (include/uapi/linux/bpf.h).
NR_LINE_INFO = 148
LINE_INFO = 152
JITED_LINE_INFO = 160
NR_JITED_LINE_INFO = 168
LINE_INFO_REC_SIZE = 172
JITED_LINE_INFO_REC_SIZE = 176

libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, 128)
    fd = libc.syscall(SYS_BPF, cmd, buf, 128)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def prog_info(fd, request):
    buf = ctypes.create_string_buffer(bytes(request), len(request))
    bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, len(request), ctypes.addressof(buf)))
    return buf


def jited_lines(prog_id):
    """[(machine code address, BPF instruction offset)] of one program."""
    fd = bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("<I", prog_id))
    try:
        first = prog_info(fd, bytearray(INFO_SIZE))
        (n,) = struct.unpack_from("<I", first, NR_LINE_INFO)
        (nj,) = struct.unpack_from("<I", first, NR_JITED_LINE_INFO)
        (rec,) = struct.unpack_from("<I", first, LINE_INFO_REC_SIZE)
        lines = ctypes.create_string_buffer(n * rec)
        addrs = ctypes.create_string_buffer(nj * 8)
        req = bytearray(INFO_SIZE)
        struct.pack_into("<I", req, NR_LINE_INFO, n)
        struct.pack_into("<Q", req, LINE_INFO, ctypes.addressof(lines))
        struct.pack_into("<Q", req, JITED_LINE_INFO, ctypes.addressof(addrs))
        struct.pack_into("<I", req, NR_JITED_LINE_INFO, nj)
        struct.pack_into("<I", req, LINE_INFO_REC_SIZE, rec)
        struct.pack_into("<I", req, JITED_LINE_INFO_REC_SIZE, 8)
        prog_info(fd, req)
    finally:
        os.close(fd)
    return [
        (struct.unpack_from("<Q", addrs, i * 8)[0], struct.unpack_from("<I", lines, i * rec)[0])
        for i in range(min(n, nj))
    ]


def source_lines(prog_id):
    """{BPF instruction offset: (file:line, source text)} of one program."""
    out = subprocess.run(
        ["bpftool", "prog", "dump", "xlated", "id", str(prog_id), "linum"],
        capture_output=True, text=True, check=True,
    ).stdout
    current, by_insn = None, {}
    for line in out.splitlines():
        if line.startswith(";"):
            m = re.search(r"\[file:(\S+) line_num:(\d+)", line)
            text = line[1:line.rfind("[file")].strip() if m else ""
            current = (f"{os.path.basename(m.group(1))}:{m.group(2)}", text[:60]) if m else None
            continue
        m = re.match(r"\s*(\d+):", line)
        if m:
            by_insn[int(m.group(1))] = current
    return by_insn


def programs(names):
    out = subprocess.run(["bpftool", "prog", "list"], capture_output=True, text=True, check=True).stdout
    ids = []
    for line in out.splitlines():
        m = re.match(r"(\d+): \S+\s+name (\S+)", line)
        if m and (not names or m.group(2) in names):
            ids.append(int(m.group(1)))
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--program", action="append", default=[], help="program name (repeatable; default: all)")
    ap.add_argument("--top", type=int, default=40, help="source lines to print")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        subprocess.run(
            ["perf", "record", "-q", "-a", "-o", data, "--", "sleep", str(args.seconds)],
            check=True, stdout=subprocess.DEVNULL,
        )
        ids = programs(set(args.program))
        if not ids:
            sys.exit("no such program loaded (is the workload still running?)")
        points, sources = [], {}
        for pid in ids:
            points += [(addr, insn, pid) for addr, insn in jited_lines(pid)]
            sources[pid] = source_lines(pid)
        points.sort()
        addrs = [p[0] for p in points]
        samples = subprocess.run(
            ["perf", "script", "-i", data, "-F", "ip,sym"], capture_output=True, text=True, check=True,
        ).stdout

    by_symbol, by_line, total = collections.Counter(), collections.Counter(), 0
    for line in samples.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        total += 1
        sym = fields[1]
        if not sym.startswith("bpf_prog_"):
            by_symbol[sym] += 1
            continue
        func = sym.split("_", 3)[-1]
        by_symbol["bpf:" + func] += 1
        i = bisect.bisect_right(addrs, int(fields[0], 16)) - 1
        if i >= 0:
            _, insn, pid = points[i]
            where = sources[pid].get(insn) or ("?", "")
            by_line[(func,) + where] += 1
    if not total:
        sys.exit("no samples")
    print("share of all samples, by symbol:")
    for sym, n in by_symbol.most_common(20):
        print(f"{100 * n / total:6.2f}%  {sym}")
    print("\nshare of all samples, by BPF function and source line:")
    for (func, where, text), n in by_line.most_common(args.top):
        print(f"{100 * n / total:6.2f}%  {func[:24]:24} {where:28} {text}")


if __name__ == "__main__":
    main()
