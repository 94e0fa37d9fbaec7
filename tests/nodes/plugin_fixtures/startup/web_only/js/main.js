// fixture extension
export const fixture = "main";
