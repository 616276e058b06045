# mypy: ignore-errors
"""Timeline of one ``python -m tools.warmup FILE`` with Python's files warm: when each phase
of the command starts and ends, and how much the head start read (instrumentation for one
H200 lease; wraps the command's own functions, adds a perf_counter call to each)."""

import atexit
import os
import sys
import threading
import time

T0 = time.perf_counter()


def disk_read_bytes() -> int:
    """Bytes read from the disk holding the model so far (/proc/diskstats, whole disks)."""
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            name = fields[2]
            if (name.startswith(("vd", "sd", "nvme")) and not name[-1].isdigit()) or (
                    name.startswith("nvme") and "p" not in name[4:]):
                total += int(fields[5]) * 512
    return total


DISK0 = disk_read_bytes()


def mark(what: str) -> None:
    disk = (disk_read_bytes() - DISK0) / 1e9
    print(f"{time.perf_counter() - T0:7.3f} s  disk {disk:5.2f} GB  {what}", file=sys.stderr,
          flush=True)


mark("python up")
import tools.warmup as tw  # noqa: E402  (after the first mark, on purpose)
from tools.warmup import early  # noqa: E402

mark("tools.warmup imported")
atexit.register(lambda: mark("atexit (interpreter shutting down)"))
early_bytes = [0]
sendfile = os.sendfile


def counted_sendfile(out, fd, offset, count):  # type: ignore[no-untyped-def]
    n = sendfile(out, fd, offset, count)
    if threading.current_thread().name == "moestream-warm-early":
        early_bytes[0] += n
    return n


os.sendfile = counted_sendfile
start_early, stop_early = tw.start_early, early.EarlyRead.stop


def timed(owner, name, label):  # type: ignore[no-untyped-def]
    fn = getattr(owner, name)

    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        mark(f"{label} ...")
        out = fn(*args, **kwargs)
        mark(f"{label} done")
        return out

    setattr(owner, name, wrapped)


def start(args):  # type: ignore[no-untyped-def]
    started = start_early(args)
    mark(f"early read started: {started is not None}")
    import tools.warmup.cli as cli
    from stages import residency

    mark("cli imported (numpy, pipeline)")
    timed(cli, "open_table", "open_table")
    timed(cli, "check_ram", "check_ram")
    timed(cli, "_warm", "engine")
    of_files = residency.Residency.of_files.__func__

    @classmethod
    def of_files_timed(cls, files):  # type: ignore[no-untyped-def]
        mark("residency ...")
        out = of_files(cls, files)
        mark("residency done")
        return out

    residency.Residency.of_files = of_files_timed
    return started


def stop(self, timeout_s=5.0):  # type: ignore[no-untyped-def]
    mark(f"early stop asked ({early_bytes[0] / 1e9:.2f} GB read early)")
    prefix = stop_early(self, timeout_s)
    mark(f"early stopped ({early_bytes[0] / 1e9:.2f} GB read early, "
         f"{prefix / 1e9:.2f} GB handed over)")
    return prefix


tw.start_early, early.EarlyRead.stop = start, stop
def sample() -> None:  # the disk's progress every 50 ms, beside the command's own marks
    while True:
        time.sleep(0.05)
        mark("")


threading.Thread(target=sample, daemon=True).start()
code = tw.main(sys.argv[1:])
mark("main returned")
sys.exit(code)
