# Functions shared by the sbatch scripts in this folder; sourced by them, not submitted itself.
#
# me_layout CONFIG OVERRIDES...   eval the job's node split (RUN_DIR, LOG_DIR, SERVER_NODELIST,
#                                 TRAINER_NODELIST, NUM_SERVERS, URLS_FILE, ...; see
#                                 megatron_entropy/runtime/slurm.py)
# me_start_servers CONFIG OVERRIDES...   start the rollout servers as one background step and
#                                 wait until every one answers; writes $URLS_FILE
# me_train CONFIG OVERRIDES...    run the trainer step (one task per GPU) in the background and
#                                 wait for it, forwarding USR1/TERM to it; sets TRAIN_RC
# me_finish                       stop the servers; requeue the job if the trainer was preempted
#                                 (exit code 75), else exit with the trainer's code
#
# Environment: PYTHON (default python), TRAINER_SRUN_ARGS / SERVER_SRUN_ARGS (extra srun options,
# e.g. "--gpus-per-task=1" where the site binds GPUs per task), MAX_REQUEUES (default 50),
# TRAINER_EXIT_GRACE (seconds the other ranks get once one has exited; default 120).

ME_PREEMPTED_RC=75
PYTHON=${PYTHON:-python}
ME_SERVER_PID=
ME_TRAINER_PID=
ME_PREEMPT_REQUESTED=0
TRAIN_RC=

me_log() { echo "[$(date +%T) ${SLURM_JOB_ID:-nojob}] $*"; }

me_layout() {
  local out
  out=$("$PYTHON" -m megatron_entropy.runtime.slurm layout --nodelist "$SLURM_JOB_NODELIST" "$@") \
    || { me_log "the job's layout is not valid for this config (see above)"; exit 1; }
  eval "$out"
  mkdir -p "$LOG_DIR"
  me_log "run dir $RUN_DIR (restart ${SLURM_RESTART_COUNT:-0})"
  me_log "trainer: $TRAINER_TASKS tasks on $TRAINER_NODELIST"
  if [ "$START_SERVERS" = 1 ]; then
    me_log "servers: $NUM_SERVERS x $ENGINE ($SERVER_GPUS GPU each) on $SERVER_NODELIST"
  fi
}

# `wait` returns early when a trapped signal arrives; wait again until the process is gone.
me_wait() {
  while :; do
    wait "$1"
    kill -0 "$1" 2>/dev/null || { wait "$1"; return $?; }
  done
}

me_on_signal() {
  ME_PREEMPT_REQUESTED=1
  if [ -n "$ME_TRAINER_PID" ]; then
    me_log "$1: asking the trainer to checkpoint and stop"
    kill -USR1 "$ME_TRAINER_PID" 2>/dev/null || true  # srun passes it on to every task
  else
    me_log "$1 with no trainer running"
  fi
}
trap 'me_on_signal USR1' USR1
trap 'me_on_signal TERM' TERM

me_stop_servers() {
  if [ -n "$ME_SERVER_PID" ] && kill -0 "$ME_SERVER_PID" 2>/dev/null; then
    me_log "stopping the servers"
    # TERM to the step's tasks lets the servers shut down; TERM to srun would kill them.
    local step i
    step=$(squeue --steps --jobs "$SLURM_JOB_ID" --noheader --format "%i %j" 2>/dev/null |
           awk '$2 == "rollout-servers" {print $1; exit}')
    scancel --signal=TERM "${step:-none}" 2>/dev/null || kill -TERM "$ME_SERVER_PID" 2>/dev/null
    for i in $(seq 30); do
      kill -0 "$ME_SERVER_PID" 2>/dev/null || break
      sleep 1
    done
    kill -TERM "$ME_SERVER_PID" 2>/dev/null || true  # still up: srun ends the step
    wait "$ME_SERVER_PID" 2>/dev/null || true
  fi
  ME_SERVER_PID=
}

me_start_servers() {
  [ "$START_SERVERS" = 1 ] || return 0
  rm -rf "$URLS_DIR" "$URLS_FILE"
  local overlap=()
  [ "$SHARED_NODE" = 1 ] && overlap=(--overlap)
  # shellcheck disable=SC2086  # SERVER_SRUN_ARGS is a list of options
  srun --job-name=rollout-servers --nodes="$NUM_SERVER_NODES" --nodelist="$SERVER_NODELIST" \
    --ntasks="$NUM_SERVERS" --ntasks-per-node="$SERVERS_PER_NODE" "${overlap[@]}" \
    --kill-on-bad-exit=0 \
    --output="$LOG_DIR/server-%t.log" --open-mode=append ${SERVER_SRUN_ARGS:-} \
    "$PYTHON" -m megatron_entropy.runtime.slurm serve --urls-dir "$URLS_DIR" "$@" &
  ME_SERVER_PID=$!
  me_log "waiting for $NUM_SERVERS servers (logs: $LOG_DIR/server-*.log)"
  if ! "$PYTHON" -m megatron_entropy.runtime.slurm wait-servers --urls-dir "$URLS_DIR" \
      --count "$NUM_SERVERS" --out "$URLS_FILE" --timeout "$STARTUP_TIMEOUT" \
      --pid "$ME_SERVER_PID"; then
    me_log "the servers did not come up"
    me_stop_servers
    exit 1
  fi
  me_log "servers ready: $(tr '\n' ' ' < "$URLS_FILE")"
}

me_train() {
  local extra=()
  [ "$START_SERVERS" = 1 ] && extra=("rollout.server.urls_file=$URLS_FILE")
  if [ "$ME_PREEMPT_REQUESTED" = 1 ]; then  # the warning came while servers started
    TRAIN_RC=$ME_PREEMPTED_RC
    return
  fi
  # Ranks end a step or a preemption checkpoint together but leave at slightly different
  # times, so a task's exit (even non-zero: 75) must not kill the others: the rest get
  # TRAINER_EXIT_GRACE seconds to finish, then srun ends them (a crashed rank's peers hang).
  # shellcheck disable=SC2086
  srun --job-name=trainer --nodes="$NUM_TRAINER_NODES" --nodelist="$TRAINER_NODELIST" \
    --ntasks="$TRAINER_TASKS" --ntasks-per-node="$TRAINER_TASKS_PER_NODE" --kill-on-bad-exit=0 \
    --wait="${TRAINER_EXIT_GRACE:-120}" \
    --output="$LOG_DIR/trainer.log" --open-mode=append --label ${TRAINER_SRUN_ARGS:-} \
    "$PYTHON" -m megatron_entropy.cli train "$@" "${extra[@]}" &
  ME_TRAINER_PID=$!
  me_log "trainer started (log: $LOG_DIR/trainer.log)"
  if [ -n "$ME_SERVER_PID" ]; then
    # Whichever ends first: a server step that dies takes the job down with it.
    while kill -0 "$ME_TRAINER_PID" 2>/dev/null; do
      if ! kill -0 "$ME_SERVER_PID" 2>/dev/null; then
        me_log "the server step ended while the trainer runs; stopping the trainer"
        kill -TERM "$ME_TRAINER_PID" 2>/dev/null || true
        sleep 1
        kill -TERM "$ME_TRAINER_PID" 2>/dev/null || true
        break
      fi
      sleep 5 & wait $! 2>/dev/null || true
    done
  fi
  me_wait "$ME_TRAINER_PID" && TRAIN_RC=0 || TRAIN_RC=$?
  ME_TRAINER_PID=
  me_log "trainer exited with code $TRAIN_RC"
}

me_finish() {
  me_stop_servers
  if [ "$TRAIN_RC" = "$ME_PREEMPTED_RC" ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MAX_REQUEUES:-50}" ]; then
      me_log "preempted, but the job was requeued ${SLURM_RESTART_COUNT} times already; stopping"
      exit "$ME_PREEMPTED_RC"
    fi
    me_log "preempted: checkpoint written; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    sleep 60  # requeue ends this script; never report success before it does
    exit "$ME_PREEMPTED_RC"
  fi
  exit "$TRAIN_RC"
}
