-- complete_batch's statement runs its generic plan on every call. Left to
-- the plan cache's choice, it was planned again on each call (a custom plan
-- for each flush's arrays: its estimated cost is below the generic plan's,
-- which assumes larger arrays), and the planning cost more than the
-- statement. The generic plan is made under the function's own settings,
-- so it finds each record by primary key.
ALTER FUNCTION __SCHEMA__.complete_batch(text[], text[], text[], jsonb[])
    SET plan_cache_mode = force_generic_plan;
