"""The CI soak: 1,000 mixed units of work through a real server process (benchmarks/serving/soak.py on the tiny model).

Complete utterances, cancels and disconnects mid-stream, bad messages, whitespace-only and oversize messages,
HTTP requests good and bad; afterwards the server's RSS has not grown by 20 MB since the warm-up, nothing is
left open, and every counter in /metrics equals what the clients saw.
"""

from __future__ import annotations

import json

from benchmarks.serving.soak import Options, run


def test_a_thousand_mixed_utterances_leave_the_server_as_they_found_it() -> None:
    report = run(Options(model="synthetic:tiny", device="cpu", utterances=1000, concurrency=6, max_rss_growth_mb=20))
    failed = {name: check for name, check in report["checks"].items() if not check["ok"]}
    assert not failed, json.dumps(failed, indent=2)
    assert set(report["units"]) == {"speak", "cancel", "disconnect", "bad_message", "whitespace", "oversize",
                                    "http", "http_bad"}
    assert sum(report["units"].values()) == 1000
    assert report["checks"]["ws utterances, all reasons"]["actual"] > 600
