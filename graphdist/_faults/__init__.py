"""Fault injection into ``graphdist run`` (test tooling, apart from the runtime it tests): what
to inject and what a run did (``faults``), and the runner (``injector``) behind the pytest
plugin's ``graphdist_faults`` fixture. It drives the launcher from outside, as a subprocess, and
reads the launcher's structured events (``--output-format jsonl``), never its words."""
