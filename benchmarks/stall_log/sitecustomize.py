"""Put on a server's PYTHONPATH by ``benchmarks.stalls.with_stall_log``: log its stalls."""

from benchmarks.stalls import install

install()
