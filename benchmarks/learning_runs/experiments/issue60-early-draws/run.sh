#!/bin/bash
# issue 60 part 2: the extra tokens of the gate's early draws on the learning benchmark's own runs (its configs),
# with main's code (the report itself runs a frozen commit without early draws)
set -u
cd /work/issue60
PY=/work/main/.venv/bin
export PYTHONPATH=/work/frozen-60
$PY/clgrpo model serve qwen2.5-coder-0.5b --port 18001 --slots 8 > policy.log 2>&1 &
P1=$!
$PY/clgrpo model serve qwen2.5-coder-1.5b --port 18002 --slots 2 > learner.log 2>&1 &
P2=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:18001/v1/models >/dev/null && curl -sf http://127.0.0.1:18002/v1/models >/dev/null && break; sleep 2; done
for name in ranges-l15-s0 durations-l15-s1 average-l15-s0 ranges-l15-s2; do
  sed -e "s#^db_path: .*#db_path: /work/issue60/early.duckdb#" \
      -e "0,/base_url:/s#base_url: .*#base_url: http://127.0.0.1:18001/v1#" \
      /work/report57/out/configs/$name.yaml > cfg-$name.yaml
  python3 - cfg-$name.yaml <<'P'
import sys,re
p=sys.argv[1]; s=open(p).read()
i=s.index("learner:"); j=s.index("base_url:", i)
k=s.index("\n", j)
s=s[:j]+"base_url: http://127.0.0.1:18002/v1"+s[k:]
open(p,"w").write(s)
P
  echo "== $name $(date)"; $PY/clgrpo train --config cfg-$name.yaml --run-id early-$name > train-$name.log 2>&1; echo "rc=$? $(date)"
done
kill $P1 $P2
echo done
