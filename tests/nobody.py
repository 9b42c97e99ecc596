"""Running a child process as the user ``nobody`` from a root test, under any checkout.

A checkout or interpreter under a folder others cannot enter (CI's clean clone in a ``mktemp -d``
folder, pyenv under ``/root``) is no obstacle: the child starts as ``nobody`` holding
CAP_DAC_READ_SEARCH only (to read the interpreter and its packages) and, after its imports, runs
``DROP_CAPABILITIES``, which drops every capability and prints its credentials; a test checks
that line is ``AS_PLAIN_NOBODY``, so what follows ran with nobody's own rights and nothing more.
"""

from __future__ import annotations

import textwrap

NOBODY = 65534
# nobody, allowed to read and traverse every folder until DROP_CAPABILITIES runs
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
AS_NOBODY += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
# What a client prints once it holds nothing but nobody's own rights: its uids and capabilities
AS_PLAIN_NOBODY = f"AS uid={NOBODY} euid={NOBODY} CapEff=0 CapPrm=0 CapAmb=0"

# Run by every client after its imports: drops all capabilities (capset(2) with empty sets also
# empties the ambient set) and prints the credentials it is left with (AS_PLAIN_NOBODY).
DROP_CAPABILITIES = textwrap.dedent(
    """
    import ctypes as _ct, os as _os
    _header = (_ct.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if _ct.CDLL(None, use_errno=True).capset(_header, (_ct.c_uint32 * 6)()) != 0:
        raise OSError(_ct.get_errno(), "capset")
    _status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    _caps = " ".join(f"{k}={int(_status[k], 16):x}" for k in ("CapEff", "CapPrm", "CapAmb"))
    print(f"AS uid={_os.getuid()} euid={_os.geteuid()} {_caps}", flush=True)
    """
)


def nobody_code(imports: str, body: str) -> str:
    """A child's code: its imports (run with the capability), then DROP_CAPABILITIES, then
    what it does as a plain nobody."""
    return textwrap.dedent(imports) + DROP_CAPABILITIES + textwrap.dedent(body)
