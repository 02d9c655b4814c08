"""Hostfiles, the include/exclude grammar, and choosing which slots of which hosts a job uses.

A hostfile is MPI-style, one host per line: `worker-1 slots=4`. Blank lines and `#` comments are skipped;
anything else that does not parse is an error naming the line number and text (DeepSpeed tolerates
trailing junk after the slot count; we accept only a trailing comment so that typos are caught).

Resources are an ordered `{host: [slot ids]}`; the order is the rank order (global ranks are handed out
host by host in this order). The encoded form (`world_info`) is DeepSpeed's: urlsafe base64 of that JSON.
"""

from __future__ import annotations

import base64
import json
import re

from shardspeed.launcher import LauncherError

Resources = dict[str, list[int]]

_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)\s*(#.*)?$")
# Host names and addresses: DNS names, IPv4 and IPv6 literals. They end up in ssh/pdsh/mpirun command
# lines and in the remote shell command, so anything that a shell would read as syntax is refused here.
_HOST = re.compile(r"^[A-Za-z0-9_.:-]+$")


def check_host_name(host: str, where: str) -> None:
    """Raise LauncherError naming `where` unless `host` is a plain host name or address."""
    # A host name starting with '-' would be read as an option by ssh, pdsh and mpirun.
    if host.startswith("-"):
        raise LauncherError(f"{where}: a host name cannot start with '-'")
    if not _HOST.match(host):
        raise LauncherError(
            f"{where}: host name {host!r} may contain only letters, digits and '.', '_', ':', '-'"
        )


def parse_hostfile_text(text: str, source: str = "hostfile") -> dict[str, int]:
    """`{host: slot count}` in file order; raises LauncherError naming the bad line."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {number}: {raw.strip()!r}"
        match = _LINE.match(line)
        if match is None:
            raise LauncherError(f"{where} does not parse; expected '<hostname> slots=<count>'")
        host, slots = match["host"], match["slots"]
        if not slots.isdigit() or int(slots) < 1:
            raise LauncherError(f"{where}: slots must be a whole number >= 1, got {slots!r}")
        check_host_name(host, where)
        if host in hosts:
            raise LauncherError(f"{where}: host {host!r} is listed twice (hosts must be unique)")
        hosts[host] = int(slots)
    if not hosts:
        raise LauncherError(f"{source} lists no hosts; expected lines like 'worker-1 slots=4'")
    return hosts


def read_hostfile(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as err:
        raise LauncherError(f"cannot read hostfile {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise LauncherError(f"hostfile {path} is not UTF-8 text") from None
    return parse_hostfile_text(text, source=path)


def parse_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse `host[:slot,slot][@host...]` into `{host: slots or None (= the whole host)}`."""
    result: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slot_text = part.partition(":")
        if not host or (sep and not slot_text):
            raise LauncherError(f"{flag} {spec!r}: bad node spec {part!r}; expected host or host:slot,slot")
        slots = None
        if sep:
            try:
                slots = sorted({int(s) for s in slot_text.split(",")})
            except ValueError:
                raise LauncherError(
                    f"{flag} {spec!r}: slots of {host!r} must be integers, got {slot_text!r}"
                ) from None
        if host in result:
            previous = result[host]
            # `a:0@a:1` means slots 0 and 1; `a@a:1` means all of a.
            slots = None if previous is None or slots is None else sorted(set(previous) | set(slots))
        result[host] = slots
    return result


def _check_known(pool: Resources, wanted: dict[str, list[int] | None], flag: str) -> None:
    for host, slots in wanted.items():
        if host not in pool:
            raise LauncherError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(pool)})")
        for slot in slots or ():
            if slot not in pool[host]:
                raise LauncherError(f"{flag}: host {host!r} has no slot {slot} (its slots: {pool[host]})")


def apply_filters(pool: Resources, include: str = "", exclude: str = "") -> Resources:
    """Keep the included slots, or drop the excluded ones; hosts left empty are dropped; order is kept."""
    if include and exclude:
        raise LauncherError("--include and --exclude cannot be used together")
    if include:
        wanted = parse_filter(include, "--include")
        _check_known(pool, wanted, "--include")
        chosen = {h: (list(pool[h]) if wanted[h] is None else wanted[h]) for h in pool if h in wanted}
    elif exclude:
        unwanted = parse_filter(exclude, "--exclude")
        _check_known(pool, unwanted, "--exclude")
        chosen = {}
        for host, slots in pool.items():
            if host in unwanted and unwanted[host] is None:
                continue  # a bare host name excludes the whole host
            drop = set(unwanted.get(host) or ())
            chosen[host] = [s for s in slots if s not in drop]
    else:
        chosen = {h: list(s) for h, s in pool.items()}
    chosen = {h: s for h, s in chosen.items() if s}
    if not chosen:
        raise LauncherError("the include/exclude filters leave no slots to run on")
    return chosen


def select_resources(
    pool: Resources, include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1
) -> Resources:
    """DeepSpeed's selection order: filters, then the first `num_nodes` hosts, then `num_gpus` per host."""
    if (num_nodes > 0 or num_gpus > 0) and (include or exclude):
        raise LauncherError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    active = apply_filters(pool, include, exclude)
    if num_nodes > 0:
        if num_nodes > len(active):
            raise LauncherError(f"--num_nodes {num_nodes} but only {len(active)} host(s) are available")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        # Without GPUs a slot is just a CPU process, so asking for more slots than listed is allowed.
        active = {host: list(range(num_gpus)) for host in active}
    return active


def parse_core_list(text: str) -> list[int]:
    """`1,3-5,7` -> [1, 3, 4, 5, 7] (order kept, duplicates dropped)."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last) + 1) if dash else [int(first)]
        except ValueError:
            raise LauncherError(
                f"--bind_core_list {text!r}: {part!r} is not a core number or range"
            ) from None
        if not span:
            raise LauncherError(f"--bind_core_list {text!r}: empty range {part!r}")
        cores.extend(c for c in span if c not in cores)
    return cores


def encode_world_info(resources: Resources) -> str:
    return base64.urlsafe_b64encode(json.dumps(resources).encode()).decode()


def decode_world_info(text: str) -> Resources:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(text.encode()))
    except ValueError:
        raise LauncherError("--world_info is not base64-encoded JSON") from None
    if not isinstance(decoded, dict) or not all(isinstance(v, list) for v in decoded.values()):
        raise LauncherError("--world_info must encode a JSON object {host: [slot, ...]}")
    return {str(h): [int(s) for s in v] for h, v in decoded.items()}
