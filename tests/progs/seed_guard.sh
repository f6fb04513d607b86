#!/bin/sh
# A guard written the way the field writes it (the seed's npu-hold): read the
# first line of ~/NPU-TOKEN (~/CLASS-TOKEN for the class in $1), take the pid
# after the word "pid", and pass only if that pid is an ancestor of this
# process, walking the parents in /proc/PID/stat. Exit 0 inside, 1 outside.
holder=$(head -n 1 "$HOME/${1:-NPU}-TOKEN" 2>/dev/null |
    awk '{ for (i = 1; i < NF; i++) if ($i == "pid") { print $(i + 1); exit } }')
case $holder in '' | *[!0-9]*) exit 1 ;; esac
p=$$
while [ "$p" -gt 1 ]; do
    [ "$p" -eq "$holder" ] && exit 0
    # "pid (comm) state ppid ...": the last ")" ends comm, whatever it holds.
    p=$(sed 's/.*) [A-Za-z] \([0-9]*\) .*/\1/' "/proc/$p/stat" 2>/dev/null) || exit 1
    case $p in '' | *[!0-9]*) exit 1 ;; esac
done
exit 1
