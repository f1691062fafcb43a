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

need_run() {  # RESULT_JSON SCRIPT: exit with a message unless that run finished (SCRIPT writes it)
  finished "$1" || { echo "no finished $1: run $2 first" >&2; exit 1; }
}

evaluate() {  # KIND DIR FLAGS...: python -m jaxkv.eval KIND FLAGS --out DIR, unless that run finished
  # (fidelity with $KVZIP_REQUEST set: --kvzip-request that; the scripts of runs recorded before
  # session 40 set chat, kvzip's request then)
  local kind=$1 dir=$2 request=()
  shift 2
  if finished "$dir/$kind.json"; then echo "skip $dir (done)"; return; fi
  [[ $kind == fidelity && -n ${KVZIP_REQUEST:-} ]] && request=(--kvzip-request "$KVZIP_REQUEST")
  "$py" -m jaxkv.eval "$kind" "$@" "${request[@]}" --out "$dir"
}

prose_tail_check() {  # OUT GRANULARITY POLICIES: decode-protocol fidelity at r = 0.25 and
  # 0.125 on 8 windows (256 + 128 tokens) of tinyshakespeare's last 10 %, into OUT: the
  # ablations' evaluation (ablate_rl.sh, ablate_training.sh).
  evaluate fidelity "$1" --ratios 0.25,0.125 --limit 8 --window 384 --prompt-len 256 \
    --protocol decode --granularity "$2" --policies "$3"
}

tier_candidate() {  # DIR F [SRC]: a ranker's params (SRC, default the recall ranker) with an
  # attended tier of F, saved once as DIR (ranker.retier); prints the candidate as
  # POLICY=CHECKPOINT for the tier protocols
  [[ -f $1/ranker.json ]] || "$py" -c "
from jaxkv.policies.ranker import retier
retier('${3:-ranker_recall_smollm2_cpu}', '$1', attended_fraction=$2)" >&2
  echo "ranker:$1=$1"
}

domain_check() {  # OUT POLICIES: decode-protocol fidelity, global granularity, r = 0.25 and
  # 0.125, on 4 windows of each training domain's text (runs/retrieval_attended/<domain>.txt,
  # written once) into OUT/check_<domain>: the tier protocols' training-domain check.
  local domain text
  for domain in prose math code chat; do
    text=runs/retrieval_attended/$domain.txt
    [[ -f $text ]] || write_text "$domain" "$text"
    evaluate fidelity "$1/check_$domain" --text "$text" --limit 4 --window 384 \
      --prompt-len 256 --protocol decode --granularity global --ratios 0.25,0.125 \
      --policies "$2"
  done
}

retrieval_runs() {  # OUT DATA_SEED GLOBAL_POLICIES [HEAD_POLICIES]: passkey and needle at
  # 1K / 2K, r = 0.25, 8 prompts each (RETRIEVAL_LIMIT to change), on data seed DATA_SEED, into
  # OUT/retrieval_global (and, with HEAD_POLICIES, OUT/retrieval_head): the retrieval runs of
  # every protocol since the recall rankers'. Finished runs are skipped.
  local common=(--ratios 0.25 --limit "${RETRIEVAL_LIMIT:-8}" --data-seed "$2" --tasks passkey,needle
    --lengths 1024,2048)
  evaluate retrieval "$1/retrieval_global" "${common[@]}" --granularity global --policies "$3"
  [[ -z ${4:-} ]] || evaluate retrieval "$1/retrieval_head" "${common[@]}" \
    --granularity head --policies "$4"
}

recall_heldout() {  # OUT DATA_SEED BBH_OFFSET RETRIEVAL_GLOBAL RETRIEVAL_HEAD FIDELITY_GLOBAL
  # The recall rankers' held-out run (results/retrieval_recall*/PROTOCOL.md): retrieval at
  # r = 0.25 on data seed DATA_SEED at both granularities, then decode-protocol fidelity on the
  # BIG-Bench Hard windows at --heldout BBH_OFFSET (the policies given, and critical:h2o per
  # head). Finished runs are skipped.
  local out=$1
  retrieval_runs "$out" "$2" "$4" "$5"
  local text=runs/retrieval_recall/heldout.txt
  [[ -f $text ]] || write_text reasoning "$text"
  local fresh=(--text "$text" --heldout "$3" --limit 8 --window 384 --prompt-len 256
    --protocol decode --ratios 0.25,0.125)
  evaluate fidelity "$out/fidelity_global" "${fresh[@]}" --granularity global --policies "$6"
  evaluate fidelity "$out/fidelity_head" "${fresh[@]}" --granularity head --policies critical:h2o
}

bbh_text() {  # the held-out domain's (BIG-Bench Hard) text, written once; prints its path
  local text=runs/distillcache_tier_wide/heldout.txt
  [[ -f $text ]] || write_text reasoning "$text" >&2
  echo "$text"
}

decode_runs() {  # OUT TAG OFFSET GLOBAL_POLICIES HEAD_EXTRA FLAGS...: decode-protocol
  # fidelity on 8 BIG-Bench Hard windows at --heldout OFFSET into OUT/decode_<granularity>TAG:
  # GLOBAL_POLICIES at global, HEAD_EXTRA (may be empty) and the decode heuristics per head,
  # critical:h2o per layer; FLAGS (ratios, --evict-every) go to every run.
  local out=$1 tag=$2 text
  text=$(bbh_text)
  local fresh=(--text "$text" --heldout "$3" --limit 8 --window 384 --prompt-len 256
    --protocol decode "${@:6}")
  evaluate fidelity "$out/decode_global$tag" "${fresh[@]}" --granularity global --policies "$4"
  evaluate fidelity "$out/decode_head$tag" "${fresh[@]}" --granularity head \
    --policies "${5:+$5,}critical:h2o,h2o,tova,snapkv"
  evaluate fidelity "$out/decode_layer$tag" "${fresh[@]}" --granularity layer \
    --policies critical:h2o
}

decode_heldout() {  # OUT POLICIES [OFFSET]: the decode protocols' held-out run (results/
  # distillcache_tier_wide/PROTOCOL.md, distillcache_blend_decode/PROTOCOL.md and
  # distillcache_peak/PROTOCOL.md): decode_runs at --heldout OFFSET (default 0.125), r = 0.25
  # and 0.125, POLICIES at global, then the table (OUT/tables.md).
  decode_runs "$1" "" "${3:-0.125}" "$2" "" --ratios 0.25,0.125
  "$py" scripts/distillcache_confirm_report.py "$1" --runs decode_global,decode_head,decode_layer
}

prefill_confirm() {  # OUT POLICY KVPRESS_RUN TEXT HELDOUT OFFSET: the prefill protocol's
  # confirmation runs on 8 windows of TEXT (fidelity's --heldout HELDOUT --offset OFFSET):
  # POLICY beside every heuristic at the granularities of $PREFILL_RUNS (default all but
  # global_nocap_chat; global_nocap is global without floor or cap, global_nocap_chat the same
  # with kvzip's repeat request of before session 40), then kvpress's KVzipPress on the same
  # windows (its run folder KVPRESS_RUN, once), and OUT/tables.md
  local out=$1 policy=$2 run=$3 text=$4 heldout=$5 offset=$6
  local fresh=(--text "$text" --heldout "$heldout" --offset "$offset" --limit 8 --window 384
    --prompt-len 256 --ratios 0.25,0.125 --protocol prefill)
  local runs=${PREFILL_RUNS:-global_nocap global head layer adaptive shared}
  local heur=critical:h2o,h2o,tova more=snapkv,expected_attention,streaming_llm
  local nocap="--granularity global --head-floor 0 --head-cap 8"
  local -A flags=(
    [global_nocap]="$nocap --policies $policy,kvzip,oracle"
    [global_nocap_chat]="$nocap --kvzip-request chat --policies $policy,kvzip"
    [global]="--granularity global --policies $policy,kvzip,$heur,$more,oracle"
    [head]="--granularity head --policies kvzip,$heur,$more"
    [layer]="--granularity layer --policies kvzip,$heur"
    [adaptive]="--granularity adaptive --policies kvzip,$heur"
    [shared]="--granularity shared --policies $heur"
  )
  local name planned=()
  for name in $runs; do
    [[ -v "flags[$name]" ]] || { echo "prefill_confirm: unknown run '$name'" >&2; return 2; }
    # shellcheck disable=SC2086  # the flags split into words (no word holds a space)
    evaluate fidelity "$out/prefill_$name" "${fresh[@]}" ${flags[$name]}
    planned+=("prefill_$name")
  done
  if [[ ! -f $out/kvpress.json ]]; then
    HELDOUT=$heldout OFFSET=$offset LIMIT=8 OUT=$run RESULTS=$out/kvpress_comparison \
      STEPS="1 2 4 5" PRESSES=KVzipPress scripts/compare_kvpress.sh "$text"
    cp "$run/kvpress.json" "$out/kvpress.json"
  fi
  "$py" scripts/distillcache_confirm_report.py "$out" --runs "$(IFS=,; echo "${planned[*]}")"
}
