"""The events and metrics extras stay optional: `import kvpool` loads none of
pyzmq, msgspec or prometheus_client, and a feature used without its package
raises an ImportError naming the extra to install."""

import subprocess
import sys


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_kvpool_loads_no_optional_dependency():
    r = run("import sys, kvpool, kvpool.events, kvpool.router\n"
            "print(sorted(m for m in ('zmq', 'msgspec', 'prometheus_client') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_missing_packages_name_their_extra():
    r = run("import sys\n"
            "sys.modules['zmq'] = sys.modules['msgspec'] = sys.modules['prometheus_client'] = None\n"
            "msgs = []\n"
            "for stmt in ('from kvpool.events import ZmqEventPublisher', 'from kvpool.router import Router; Router(1, page_size=1, hash_seed=0)',\n"
            "             'import kvpool.metrics'):\n"
            "    try:\n"
            "        exec(stmt)\n"
            "    except ImportError as e:\n"
            "        msgs.append(str(e))\n"
            "print('|'.join(msgs))")
    assert r.returncode == 0, r.stderr
    msgs = r.stdout.strip().splitlines()[-1].split("|")
    assert len(msgs) == 3
    assert "kvpool[events]" in msgs[0] and "'zmq'" in msgs[0]
    assert "kvpool[events]" in msgs[1] and "'msgspec'" in msgs[1]
    assert "kvpool[metrics]" in msgs[2]
