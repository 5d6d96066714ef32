mkdir -p /tmp/prof
for m in h2o kascade; do
  timeout 100 python3 -m jsparse.cli bench profile_decode_step --method $m --context 100000 --batch 4 --steps 4 --top 60 --out /tmp/prof/profile_$m.json > /tmp/prof_$m.log 2>&1
  echo "-- $m rc=$?"; ls /tmp/prof; cp /tmp/prof/profile_$m.hlo.txt.gz "$OUT/" || tail -3 /tmp/prof_$m.log
done
