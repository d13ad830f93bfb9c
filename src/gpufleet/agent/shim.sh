# gpufleet per-attempt shim (POSIX sh; see gpufleet/agent/shim.py for the contract).
#
#   sh shim.sh --exit-file F --log-file L [--claim-file C] [--status-fd N] [--cwd D]
#              [--cwd-check] [--cgroup-procs P]... [--setpriv PATH --uid U --gid G
#              [--groups G1,G2]] [--cwd-as U:G] [--mount-bin M [--private-tmp D]
#              [--hide-pids] [--hide-dir D]... [--keep-file F] [--shm-size MIB]]
#              [--restore-env NAME,NAME] [--script-stdin] -- cmd [args...]
#
# A second stage (as the job user, after setpriv or unshare --setuid) is this script read from
# its stdin: sh -s -- --stage2 ... -- cmd (shim.stage2_argv). The job user may not be able to
# read the script's path (a package under a 0700 directory, or under /tmp, which the private
# /tmp below hides), so the first stage opens it, as the agent's user, on fd 6 and gives it
# the second stage as stdin; the second stage gives the command /dev/null, as the first does.
# --script-stdin: the command is such a second stage (the pidns prefix: unshare ... -- sh -s).
#
# Builtins only on the common path (no fork besides the command's own, no exec besides the
# command's and, when switching users, setpriv's): this runs once per attempt.
# Variables are prefixed _gf_ because the shell's environment is the command's environment.

_gf_exit= _gf_log= _gf_claim= _gf_status= _gf_cwd= _gf_check= _gf_procs= _gf_setpriv=
_gf_uid= _gf_gid= _gf_groups= _gf_cwd_as= _gf_stage2= _gf_pwd= _gf_mount= _gf_tmp= _gf_hide=
_gf_restore= _gf_hides= _gf_keep= _gf_shm= _gf_s2in= _gf_s2=
_gf_nl='
'
while [ $# -gt 0 ]; do
    case $1 in
        --exit-file) _gf_exit=$2; shift 2 ;;
        --log-file) _gf_log=$2; shift 2 ;;
        --claim-file) _gf_claim=$2; shift 2 ;;
        --status-fd) _gf_status=$2; shift 2 ;;
        --cwd) _gf_cwd=$2; shift 2 ;;
        --cwd-check) _gf_check=1; shift ;;
        --cgroup-procs) _gf_procs=$_gf_procs$2$_gf_nl; shift 2 ;;
        --setpriv) _gf_setpriv=$2; shift 2 ;;
        --uid) _gf_uid=$2; shift 2 ;;
        --gid) _gf_gid=$2; shift 2 ;;
        --groups) _gf_groups=$2; shift 2 ;;
        --cwd-as) _gf_cwd_as=$2; shift 2 ;;
        --stage2) _gf_stage2=1; shift ;;
        --keep-pwd) _gf_pwd=1; shift ;;
        --mount-bin) _gf_mount=$2; shift 2 ;;
        --private-tmp) _gf_tmp=$2; shift 2 ;;
        --hide-pids) _gf_hide=1; shift ;;
        --hide-dir) _gf_hides=$_gf_hides$2$_gf_nl; shift 2 ;;
        --keep-file) _gf_keep=$2; shift 2 ;;
        --shm-size) _gf_shm=$2; shift 2 ;;
        --restore-env) _gf_restore=$2; shift 2 ;;
        --script-stdin) _gf_s2in=1; shift ;;
        --) shift; break ;;
        *) echo "gpufleet shim: unknown argument $1" >&2; exit 2 ;;
    esac
done

# The status pipe (fd 1-9: sh redirections take one digit) moves to fd 9 (fd 8 is the exit
# file in the child); a status pipe on stdout leaves stdout to stderr.
case $_gf_status in
    '' | 9) ;;
    1) exec 9>&1 1>&2; _gf_status=9 ;;
    [2-8]) eval "exec 9>&$_gf_status $_gf_status>&-"; _gf_status=9 ;;
    *) echo "gpufleet shim: --status-fd must be 1-9" >&2; exit 2 ;;
esac

# JSON string body of $1 (quotes, backslashes; control characters become spaces).
_gf_json() {
    _gf_s=$1 _gf_o=
    while [ -n "$_gf_s" ]; do
        _gf_r=${_gf_s#?}
        _gf_c=${_gf_s%"$_gf_r"}
        _gf_s=$_gf_r
        case $_gf_c in
            \\ | \") _gf_o=$_gf_o\\$_gf_c ;;
            [[:cntrl:]]) _gf_o="$_gf_o " ;;
            *) _gf_o=$_gf_o$_gf_c ;;
        esac
    done
}

# A start failure: nothing of the command runs. One line to the log, the exit record to
# fd 8 (the exit file, opened by the agent's user before any switch), the error to the
# agent's status pipe; the shim sees fd 8's file non-empty and leaves it as it is.
_gf_fail() {
    _gf_json "$1"
    printf 'gpufleet: %s\n' "$1" >&2
    printf '{"exit_code": 127, "start_error": "%s"}' "$_gf_o" >&8
    [ -z "$_gf_status" ] || printf '{"error": "%s"}\n' "$_gf_o" >&9
    exit 127
}

# Is $1 something exec can run? (a path: an executable file; a name: one on PATH)
_gf_runnable() {
    case $1 in
        */*) [ -f "$1" ] && [ -x "$1" ] && return 0
             [ -e "$1" ] && _gf_why="Permission denied" || _gf_why="No such file or directory"
             return 1 ;;
    esac
    _gf_why="No such file or directory"
    [ -n "$1" ] || return 1
    _gf_p=${PATH-/usr/local/bin:/usr/bin:/bin}
    while :; do
        _gf_d=${_gf_p%%:*}
        [ -f "${_gf_d:-.}/$1" ] && [ -x "${_gf_d:-.}/$1" ] && return 0
        [ "$_gf_p" = "$_gf_d" ] && return 1
        _gf_p=${_gf_p#*:}
    done
}

# The last step in the command's own process (its pid is the command's pid): check the
# command, report the pid, close the shim's descriptors, exec.
_gf_exec() {
    _gf_runnable "$1" || _gf_fail "cannot start ['$1']: $_gf_why"
    read -r _gf_self _gf_rest < /proc/self/stat
    [ -z "$_gf_status" ] || { printf '{"pid": %s}\n' "$_gf_self" >&9; exec 9>&-; }
    _gf_env
    # a second stage's stdin is this script; the command's is /dev/null
    [ -z "$_gf_stage2" ] || exec 8>&- "$@" < /dev/null
    [ -z "$_gf_s2in" ] || exec 8>&- "$@" <&6 6<&-
    exec 8>&- "$@"
}

# sh exports PWD (and cd OLDPWD): the command gets neither unless the agent passed them.
# The job's loader variables (LD_PRELOAD...) come as _GF_ENV_<name> so that nothing run as
# root sees them; they are set back here, in the command's process, never before the switch
# to the job user (the names are shell identifiers: the agent checked them).
_gf_env() {
    [ -n "$_gf_pwd" ] || unset PWD OLDPWD
    while [ -n "$_gf_restore" ]; do
        _gf_n=${_gf_restore%%,*}
        eval "$_gf_n=\${_GF_ENV_$_gf_n}; export $_gf_n; unset _GF_ENV_$_gf_n"
        [ "$_gf_restore" = "$_gf_n" ] && _gf_restore= || _gf_restore=${_gf_restore#*,}
    done
}

# Why cd "$1" failed (sh's own message has no errno text).
_gf_cdwhy() {
    [ -d "$1" ] && _gf_why="Permission denied" || _gf_why="No such file or directory"
}

if [ -n "$_gf_stage2" ]; then
    # after setpriv: enter the working directory as the job user, then run the command
    # (the agent saw it as a directory: a failure here is the job user's access)
    [ -z "$_gf_cwd" ] || cd -P -- "$_gf_cwd" 2>/dev/null || _gf_fail \
        "cannot enter working_dir '$_gf_cwd' as the job user (uid $(id -u)): Permission denied"
    _gf_exec "$@"
fi

# Survive the group's stop signal (a caught signal is reset to the default in the command;
# an ignored one would stay ignored).
trap '_gf_sig=1' TERM INT HUP

if [ -n "$_gf_claim" ]; then
    # claim the start: O_EXCL create (noclobber) races the restarted agent's abandon claim
    read -r _gf_stat < /proc/$$/stat
    _gf_ticks() { shift 19; _gf_t=$1; }
    _gf_ticks ${_gf_stat##*) }
    read -r _gf_boot < /proc/sys/kernel/random/boot_id
    set -C
    if ! { printf '{"pid": %s, "pgid": %s, "start_ticks": %s, "boot_id": "%s"}' \
            $$ $$ "$_gf_t" "$_gf_boot" > "$_gf_claim"; } 2>/dev/null; then
        [ -z "$_gf_status" ] \
            || printf '{"error": "start abandoned by the agent"}\n' >&9
        exit 0
    fi
    set +C
fi

# The exit file exists (empty) from here on; a start failure fills it through fd 8.
: > "$_gf_exit" || exit 1

(
    # a second stage as the job user reads this script from fd 6, opened here (as the agent's
    # user, before any mount). `command`: a failed redirection of exec would end the shell;
    # the braces: exec's own 2>/dev/null would stay in force for the command
    [ -z "$_gf_uid" ] || [ -z "$_gf_check$_gf_restore" ] || _gf_s2=1
    [ -z "$_gf_s2$_gf_s2in" ] || { command exec 6< "$0"; } 2>/dev/null \
        || _gf_fail "cannot open the shim script $0"
    # the child: join the cgroup(s) before anything of the command runs
    _gf_step="join the cgroup"
    while [ -n "$_gf_procs" ]; do
        { echo 0 > "${_gf_procs%%"$_gf_nl"*}"; } 2>/dev/null \
            || _gf_fail "cannot join the cgroup ${_gf_procs%%"$_gf_nl"*}"
        _gf_procs=${_gf_procs#*"$_gf_nl"}
    done
    # in the attempt's own mount namespace (the agent ran this shim under unshare --mount):
    # a private /tmp and /var/tmp, a fresh /dev/shm, a /proc showing only the job's uid
    if [ -n "$_gf_mount" ]; then
        if [ -n "$_gf_tmp" ]; then
            "$_gf_mount" --bind "$_gf_tmp" /tmp 2>/dev/null \
                || _gf_fail "cannot mount the attempt's private /tmp"
            # /tmp is the attempt's dir now: bind it again by that name, since "$_gf_tmp"
            # itself may be hidden by the mount just made (a jobs dir under /tmp)
            [ ! -d /var/tmp ] || "$_gf_mount" --bind /tmp /var/tmp 2>/dev/null \
                || _gf_fail "cannot mount the attempt's private /var/tmp"
        fi
        # the node's socket directories (/run: PostgreSQL, MySQL, Redis, podman, D-Bus...)
        # under an empty tmpfs each; the one file the job still needs from them (resolv.conf's
        # target) is opened before and bound back after, through /proc/self/fd/7
        [ -z "$_gf_keep" ] || { command exec 7< "$_gf_keep"; } 2>/dev/null \
            || _gf_fail "cannot open $_gf_keep to keep it visible"
        while [ -n "$_gf_hides" ]; do
            "$_gf_mount" -t tmpfs -o nosuid,nodev,noexec,mode=0755,size=1m tmpfs \
                "${_gf_hides%%"$_gf_nl"*}" 2>/dev/null \
                || _gf_fail "cannot hide the node's ${_gf_hides%%"$_gf_nl"*}"
            _gf_hides=${_gf_hides#*"$_gf_nl"}
        done
        if [ -n "$_gf_keep" ]; then
            "$_gf_mount" -t tmpfs -o X-mount.mkdir,nosuid,nodev,noexec,mode=0755,size=64k tmpfs \
                "${_gf_keep%/*}" 2>/dev/null && : > "$_gf_keep" 2>/dev/null \
                && "$_gf_mount" --no-canonicalize --bind /proc/self/fd/7 "$_gf_keep" 2>/dev/null \
                || _gf_fail "cannot keep $_gf_keep visible"
            exec 7<&-
        fi
        [ ! -d /dev/shm ] || "$_gf_mount" -t tmpfs \
            -o "nosuid,nodev,mode=1777${_gf_shm:+,size=${_gf_shm}m}" tmpfs /dev/shm \
            2>/dev/null || _gf_fail "cannot mount the attempt's private /dev/shm"
        [ -z "$_gf_hide" ] || "$_gf_mount" -t proc -o nosuid,nodev,noexec,hidepid=invisible \
            proc /proc 2>/dev/null || _gf_fail "cannot mount /proc with hidepid=invisible"
    fi
    if [ -n "$_gf_cwd_as" ]; then
        # the command prefix switches users itself (unshare); check the directory as the job
        # user, then enter it as ourselves
        [ -z "$_gf_cwd" ] || "$_gf_setpriv" --reuid="${_gf_cwd_as%:*}" --regid="${_gf_cwd_as#*:}" \
            --clear-groups -- /bin/sh -c 'cd -P -- "$1"' sh "$_gf_cwd" 2>/dev/null \
            || _gf_fail "cannot enter working_dir '$_gf_cwd' as the job user\
 (uid ${_gf_cwd_as%:*}): Permission denied"
        cd -P -- "$_gf_cwd" 2>/dev/null \
            || { _gf_cdwhy "$_gf_cwd"; _gf_fail "cannot enter working_dir '$_gf_cwd': $_gf_why"; }
        _gf_exec "$@"
    fi
    if [ -n "$_gf_uid" ]; then
        [ -n "$_gf_groups" ] && _gf_g=--groups=$_gf_groups || _gf_g=--clear-groups
        if [ -n "$_gf_s2" ]; then
            # a working directory chosen by the job: enter it as the job user; loader
            # variables to set back: only as the job user (this script on stdin, from fd 6)
            exec "$_gf_setpriv" --reuid="$_gf_uid" --regid="$_gf_gid" "$_gf_g" -- \
                /bin/sh -s -- --stage2 ${_gf_pwd:+--keep-pwd} --cwd "$_gf_cwd" \
                ${_gf_status:+--status-fd 9} ${_gf_restore:+--restore-env $_gf_restore} \
                -- "$@" <&6 6<&-
        fi
        # the attempt's own work directory belongs to the job user
        [ -z "$_gf_cwd" ] || cd -P -- "$_gf_cwd" 2>/dev/null \
            || { _gf_cdwhy "$_gf_cwd"; _gf_fail "cannot enter working_dir '$_gf_cwd': $_gf_why"; }
        _gf_runnable "$1" || _gf_fail "cannot start ['$1']: $_gf_why"
        read -r _gf_self _gf_rest < /proc/self/stat
        [ -z "$_gf_status" ] || { printf '{"pid": %s}\n' "$_gf_self" >&9; exec 9>&-; }
        _gf_env
        exec 8>&- "$_gf_setpriv" --reuid="$_gf_uid" --regid="$_gf_gid" "$_gf_g" -- "$@"
    fi
    if [ -n "$_gf_cwd" ]; then
        cd -P -- "$_gf_cwd" 2>/dev/null || { _gf_cdwhy "$_gf_cwd"
            _gf_fail "cannot enter working_dir '$_gf_cwd' as the job user (uid $(id -u)): $_gf_why"; }
    fi
    _gf_exec "$@"
) < /dev/null >> "$_gf_log" 2>&1 8>> "$_gf_exit"
# In the foreground: an asynchronous list would start the command with SIGINT and SIGQUIT
# ignored; the trapped stop signals are handled once it has ended.
_gf_rc=$?

# The exit record: written once the command is gone, read only once this shim is gone (so
# it is never seen half-written). A status 128+N is death by signal N (recorded as -N) only
# for the signals a job realistically dies of (HUP INT QUIT ILL ABRT BUS FPE KILL USR1 SEGV USR2
# PIPE ALRM TERM XCPU XFSZ); sh cannot tell `exit 137` from SIGKILL, any other status is the command's
# own exit code. Keep in step with shim.py's SIGNAL_STATUSES.
[ ! -s "$_gf_exit" ] || exit 0
case $_gf_rc in
    129|130|131|132|134|135|136|137|138|139|140|141|142|143|152|153) _gf_code=$((128 - _gf_rc)) ;;
    *) _gf_code=$_gf_rc ;;
esac
{ printf '{"exit_code": %s}' "$_gf_code" > "$_gf_exit"; } 2>/dev/null || exit "$_gf_rc"
exit 0
