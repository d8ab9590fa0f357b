#!/bin/bash
# cpu.sh PID -> utime+stime in seconds (all threads)
awk '{print ($14+$15)/100}' /proc/$1/stat
