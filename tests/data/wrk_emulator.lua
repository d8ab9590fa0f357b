-- A stand-in for wrk2's Lua scripting model, to run wrk/limit.lua and wrk/keyed.lua where wrk2 is not
-- installed (LuaJIT, as wrk2 embeds). Like wrk2: the script is loaded once for the main state and once
-- per thread, each with its own globals; setup(thread) runs in the main state; init() and response()
-- run in the thread's; thread:get(name) copies a thread global across; done() runs in the main state.
--
--   WRK_API_KEY=k1 luajit tests/data/wrk_emulator.lua wrk/limit.lua DURATION_S THREADS STATUS:COUNT...
--
-- Statuses are spread round-robin over the threads. Prints the script's own output, then one line
-- "headers: Name=value;..." per thread with what wrk.headers held there (what wrk2 would send).

local script, duration_s, nthreads = arg[1], tonumber(arg[2]), tonumber(arg[3])

local function copy(v)
  if type(v) ~= "table" then return v end
  local t = {}
  for k, x in pairs(v) do t[copy(k)] = copy(x) end
  return t
end

local function new_state()
  local env = setmetatable({}, { __index = _G })
  env.wrk = { headers = {}, method = "GET", path = "/" }
  env._G = env
  local chunk = assert(loadfile(script))
  setfenv(chunk, env)
  chunk()
  return env
end

local main = new_state()
local threads = {}
for i = 1, nthreads do
  local env = new_state()
  local thread = { env = env }
  function thread:get(name) return copy(self.env[name]) end
  function thread:set(name, value) self.env[name] = copy(value) end
  threads[i] = thread
  if type(main.setup) == "function" then main.setup(thread) end
  if type(env.init) == "function" then env.init({}) end
end

local i, total = 0, 0
for a = 4, #arg do
  local status, n = arg[a]:match("^(%d+):(%d+)$")
  for _ = 1, tonumber(n) do
    local t = threads[(i % nthreads) + 1]
    i = i + 1
    total = total + 1
    if type(t.env.response) == "function" then t.env.response(tonumber(status), {}, "") end
  end
end

if type(main.done) == "function" then
  main.done({ duration = duration_s * 1e6, requests = total, bytes = 0,
              errors = { connect = 0, read = 0, write = 0, status = 0, timeout = 0 } }, {}, {})
end
for _, t in ipairs(threads) do
  local parts = {}
  for k, v in pairs(t.env.wrk.headers) do table.insert(parts, k .. "=" .. v) end
  table.sort(parts)
  io.write("headers: " .. table.concat(parts, ";") .. "\n")
end
