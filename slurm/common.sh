# Functions shared by the sbatch scripts in this folder; sourced by them, not submitted itself.
#
# me_layout CONFIG OVERRIDES...   eval the job's node split (RUN_DIR, LOG_DIR, SERVER_NODELIST,
#                                 TRAINER_NODELIST, NUM_SERVERS, URLS_FILE, the GPUs each step
#                                 asks for, ...; see megatron_entropy/launch/slurm.py)
# me_start_servers CONFIG OVERRIDES...   start the rollout servers as one background step and
#                                 wait until every one answers; writes $URLS_FILE
# me_train CONFIG OVERRIDES...    run the trainer step (one task per GPU) in the background and
#                                 wait for it, forwarding USR1/TERM to it; sets TRAIN_RC
# me_finish                       stop the servers; requeue the job if the trainer was preempted
#                                 (exit code 75), else exit with the trainer's code
#
# GPUs: every step asks for its GPUs (srun --gpus-per-node) whenever the job holds any; a step
# does not get GPUs that came to the job only with --exclusive.
#
# Signals. Both ways Slurm warns a job end in a checkpoint and a requeue:
# - the --signal=B:USR1@N warning before the time limit (and at preemption, with
#   SlurmctldParameters=preempt_send_user_signal) reaches this script alone; it passes USR1 on to
#   the trainer step (srun forwards USR1 to every task as it is);
# - a preemption's GraceTime begins with SIGTERM straight to every task of every step (not to this
#   script): the trainer takes it like USR1, the servers ignore it and keep serving the step the
#   trainer finishes before its checkpoint.
# The servers stop only on SIGUSR2, which me_stop_servers sends through their srun. Nothing here
# sends TERM to an srun whose tasks should live: srun turns a TERM it receives into SIGKILL of its
# tasks. At the end of the grace time Slurm kills the whole job itself.
#
# Environment: PYTHON (default python), TRAINER_SRUN_ARGS / SERVER_SRUN_ARGS (extra srun options),
# MAX_REQUEUES (default 50), TRAINER_EXIT_GRACE (seconds the other ranks get once one has exited,
# and the trainer gets once the servers are gone; default 120), SERVER_STOP_GRACE (seconds the
# servers get to stop; default 60).

ME_PREEMPTED_RC=75
PYTHON=${PYTHON:-python}
ME_SERVER_PID=
ME_TRAINER_PID=
ME_PREEMPT_REQUESTED=0
TRAIN_RC=

me_log() { echo "[$(date +%T) ${SLURM_JOB_ID:-nojob}] $*"; }

me_layout() {
  local out
  out=$("$PYTHON" -m megatron_entropy.cli slurm layout --nodelist "$SLURM_JOB_NODELIST" "$@") \
    || { me_log "the job's layout is not valid for this config (see above)"; exit 1; }
  eval "$out"
  mkdir -p "$LOG_DIR"
  me_log "run dir $RUN_DIR (restart ${SLURM_RESTART_COUNT:-0})"
  me_log "trainer: $TRAINER_TASKS tasks on $TRAINER_NODELIST (GPUs per node: $TRAINER_STEP_GPUS)"
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

# me_wait_for PID SECONDS: 0 once PID is gone, 1 if it still runs after SECONDS.
me_wait_for() {
  local i
  for ((i = 0; i < $2; i++)); do
    kill -0 "$1" 2>/dev/null || return 0
    sleep 1
  done
  ! kill -0 "$1" 2>/dev/null
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
  [ -n "$ME_SERVER_PID" ] || return 0
  if kill -0 "$ME_SERVER_PID" 2>/dev/null; then
    me_log "stopping the servers"
    kill -USR2 "$ME_SERVER_PID" 2>/dev/null || true
    if ! me_wait_for "$ME_SERVER_PID" "${SERVER_STOP_GRACE:-60}"; then
      me_log "the servers did not stop within ${SERVER_STOP_GRACE:-60} s; ending their step"
      kill -TERM "$ME_SERVER_PID" 2>/dev/null || true
      me_wait_for "$ME_SERVER_PID" 30 || kill -KILL "$ME_SERVER_PID" 2>/dev/null || true
    fi
  fi
  wait "$ME_SERVER_PID" 2>/dev/null || true
  ME_SERVER_PID=
}

me_start_servers() {
  [ "$START_SERVERS" = 1 ] || return 0
  rm -rf "$URLS_DIR" "$URLS_FILE"
  # "${a[@]}" of an empty array is an error under set -u before bash 4.4: ${a[@]+"${a[@]}"}.
  local opts=()
  if [ "$SHARED_NODE" = 1 ]; then opts+=(--overlap); fi
  if [ "$SERVER_STEP_GPUS" -gt 0 ]; then opts+=(--gpus-per-node="$SERVER_STEP_GPUS"); fi
  # shellcheck disable=SC2086  # SERVER_SRUN_ARGS is a list of options
  srun --job-name=rollout-servers --nodes="$NUM_SERVER_NODES" --nodelist="$SERVER_NODELIST" \
    --ntasks="$NUM_SERVERS" --ntasks-per-node="$SERVERS_PER_NODE" ${opts[@]+"${opts[@]}"} \
    --kill-on-bad-exit=0 \
    --output="$LOG_DIR/server-%t.log" --open-mode=append ${SERVER_SRUN_ARGS:-} \
    "$PYTHON" -m megatron_entropy.cli slurm serve --urls-dir "$URLS_DIR" "$@" &
  ME_SERVER_PID=$!
  me_log "waiting for $NUM_SERVERS servers (logs: $LOG_DIR/server-*.log)"
  if ! "$PYTHON" -m megatron_entropy.cli slurm wait-servers --urls-dir "$URLS_DIR" \
      --count "$NUM_SERVERS" --out "$URLS_FILE" --timeout "$STARTUP_TIMEOUT" \
      --pid "$ME_SERVER_PID"; then
    me_log "the servers did not come up"
    me_stop_servers
    exit 1
  fi
  me_log "servers ready: $(tr '\n' ' ' < "$URLS_FILE")"
}

me_train() {
  local extra=() opts=()
  if [ "$START_SERVERS" = 1 ]; then extra+=("rollout.server.urls_file=$URLS_FILE"); fi
  if [ "$TRAINER_STEP_GPUS" -gt 0 ]; then opts+=(--gpus-per-node="$TRAINER_STEP_GPUS"); fi
  if [ "$ME_PREEMPT_REQUESTED" = 1 ]; then  # the warning came while servers started
    TRAIN_RC=$ME_PREEMPTED_RC
    return
  fi
  # Ranks end a step or a preemption checkpoint together but leave at slightly different
  # times, so a task's exit (even non-zero: 75) must not kill the others: the rest get
  # TRAINER_EXIT_GRACE seconds to finish, then srun ends them (a crashed rank's peers hang).
  # shellcheck disable=SC2086
  srun --job-name=trainer --nodes="$NUM_TRAINER_NODES" --nodelist="$TRAINER_NODELIST" \
    --ntasks="$TRAINER_TASKS" --ntasks-per-node="$TRAINER_TASKS_PER_NODE" \
    ${opts[@]+"${opts[@]}"} --kill-on-bad-exit=0 --wait="${TRAINER_EXIT_GRACE:-120}" \
    --output="$LOG_DIR/trainer.log" --open-mode=append --label ${TRAINER_SRUN_ARGS:-} \
    "$PYTHON" -m megatron_entropy.cli train "$@" ${extra[@]+"${extra[@]}"} &
  ME_TRAINER_PID=$!
  me_log "trainer started (log: $LOG_DIR/trainer.log)"
  if [ -n "$ME_SERVER_PID" ]; then
    # A server step that dies takes the job down, but the trainer is not cut off at once: it may
    # be writing a checkpoint; it gets TRAINER_EXIT_GRACE seconds to end on its own first.
    while kill -0 "$ME_TRAINER_PID" 2>/dev/null; do
      if ! kill -0 "$ME_SERVER_PID" 2>/dev/null; then
        me_log "the server step ended while the trainer runs; stopping the trainer within" \
               "${TRAINER_EXIT_GRACE:-120} s"
        if ! me_wait_for "$ME_TRAINER_PID" "${TRAINER_EXIT_GRACE:-120}"; then
          kill -TERM "$ME_TRAINER_PID" 2>/dev/null || true  # srun: SIGKILL to every rank
        fi
        break
      fi
      sleep 5 & wait $! 2>/dev/null || true
    done
  fi
  me_wait "$ME_TRAINER_PID" && TRAIN_RC=0 || TRAIN_RC=$?
  ME_TRAINER_PID=
  me_log "trainer exited with code $TRAIN_RC"
}

# scontrol requeue, retried: a controller that is busy or restarting must not cost the run. Once
# the requeue is made, the script waits for Slurm to end it as this very process (exec), never as
# a child: Slurm signals the job's process tree as proctrack/linuxproc finds it, and a child forked
# while it walks the tree misses the SIGTERM that kills this script and lives on, an orphan Slurm
# no longer sees (1 requeue in 10 on a busy machine). A SIGTERM meanwhile means Slurm is ending
# the job already (the requeue went through but scontrol died of it, or a cancel): no retry, the
# same wait. Not ended within 120 s, the script exits 0; the job is requeued either way.
me_requeue() {
  local i out
  trap 'me_log "SIGTERM: the job is ending"; exec sleep 120' TERM
  for i in 1 2 3 4 5; do
    if out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
      me_log "requeued job $SLURM_JOB_ID"
      exec sleep 120
    fi
    me_log "scontrol requeue $SLURM_JOB_ID failed (attempt $i of 5): ${out:-no message}"
    sleep 10
  done
  me_log "could not requeue job $SLURM_JOB_ID; its checkpoint is in $RUN_DIR: submit the same" \
         "command again to resume"
  exit "$ME_PREEMPTED_RC"
}

me_finish() {
  me_stop_servers
  if [ "$TRAIN_RC" = "$ME_PREEMPTED_RC" ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MAX_REQUEUES:-50}" ]; then
      me_log "preempted, but the job was requeued ${SLURM_RESTART_COUNT} times already; stopping"
      exit "$ME_PREEMPTED_RC"
    fi
    me_log "preempted: checkpoint written; requeueing job $SLURM_JOB_ID"
    me_requeue
  fi
  exit "$TRAIN_RC"
}
