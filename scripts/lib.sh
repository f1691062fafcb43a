# Helpers shared by the protocol scripts (distillcache_*.sh, retrieval_*.sh); sourced, not run.
# They expect $py, the Python to run jaxkv with.

finished() {  # RESULT_JSON: true when that run wrote its results to the end
  grep -qs '"complete": true' "$1"
}

write_text() {  # DOMAIN PATH: jaxkv.rl.data's text of DOMAIN, tokenized as the embedded model's
  mkdir -p "$(dirname "$2")"
  "$py" -c "
from jaxkv.evals.runner import load_eval_model
from jaxkv.rl.data import write_domain_text
write_domain_text('$1', '$2', tokenizer=load_eval_model('smollm2-135m').tokenizer)"
}

recall_heldout() {  # OUT DATA_SEED BBH_OFFSET RETRIEVAL_GLOBAL RETRIEVAL_HEAD FIDELITY_GLOBAL
  # The recall rankers' held-out run (results/retrieval_recall*/PROTOCOL.md): retrieval at
  # r = 0.25 on data seed DATA_SEED at both granularities, then decode-protocol fidelity on the
  # BIG-Bench Hard windows at --heldout BBH_OFFSET (the policies given, and critical:h2o per
  # head). Finished runs are skipped.
  local out=$1 seed=$2 offset=$3 gran policies
  local common=(--ratios 0.25 --limit 8 --data-seed "$seed" --tasks passkey,needle
    --lengths 1024,2048)
  for set in "global $4" "head $5"; do
    read -r gran policies <<< "$set"
    finished "$out/retrieval_$gran/retrieval.json" && { echo "skip retrieval_$gran"; continue; }
    "$py" -m jaxkv.eval retrieval "${common[@]}" --granularity "$gran" --policies "$policies" \
      --out "$out/retrieval_$gran"
  done
  local text=runs/retrieval_recall/heldout.txt
  [[ -f $text ]] || write_text reasoning "$text"
  local fresh=(--text "$text" --heldout "$offset" --limit 8 --window 384 --prompt-len 256
    --protocol decode --ratios 0.25,0.125)
  for set in "global $6" "head critical:h2o"; do
    read -r gran policies <<< "$set"
    finished "$out/fidelity_$gran/fidelity.json" && { echo "skip fidelity_$gran"; continue; }
    "$py" -m jaxkv.eval fidelity "${fresh[@]}" --granularity "$gran" --policies "$policies" \
      --out "$out/fidelity_$gran"
  done
}
